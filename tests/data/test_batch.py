"""Batch helpers: moving nested batches to a device, splitting and measuring them."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch

from distkit.batch import batch_size_of, split_batch, to_device
from distkit.errors import ConfigurationError

pytestmark = pytest.mark.timeout(60)

# The meta device holds no data, so "moved" is visible without a GPU.
META = torch.device("meta")

Pair = namedtuple("Pair", ["image", "label"])


def _is_meta(tensor):
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "meta"


def test_to_device_moves_tensor():
    moved = to_device(torch.ones(2, 3), META)

    assert _is_meta(moved) and moved.shape == (2, 3)


def test_to_device_moves_nested_containers_and_keeps_their_types():
    batch = {
        "inputs": (torch.ones(2), [torch.zeros(3), {"mask": torch.ones(1)}]),
        "pair": Pair(image=torch.ones(2, 2), label=torch.tensor([1, 0])),
        "name": "batch-0",
        "index": 7,
    }

    moved = to_device(batch, META)

    assert type(moved) is dict and moved.keys() == batch.keys()
    inputs = moved["inputs"]
    assert type(inputs) is tuple and type(inputs[1]) is list and type(inputs[1][1]) is dict
    assert _is_meta(inputs[0]) and _is_meta(inputs[1][0]) and _is_meta(inputs[1][1]["mask"])
    assert type(moved["pair"]) is Pair
    assert _is_meta(moved["pair"].image) and _is_meta(moved["pair"].label)
    assert moved["pair"].label.dtype == torch.int64
    assert moved["name"] == "batch-0" and moved["index"] == 7
    assert batch["pair"].image.device.type == "cpu", "the input batch is not modified"


def test_to_device_keeps_ordered_dict_order():
    batch = OrderedDict([("b", torch.ones(1)), ("a", torch.ones(2))])

    moved = to_device(batch, META)

    assert type(moved) is OrderedDict
    assert list(moved) == ["b", "a"]
    assert all(_is_meta(v) for v in moved.values())


def test_to_device_moves_defaultdict():
    batch = defaultdict(list, {"x": torch.ones(2)})

    moved = to_device(batch, META)

    assert type(moved) is defaultdict and moved.default_factory is list
    assert _is_meta(moved["x"])


def test_to_device_same_device_keeps_values():
    tensor = torch.arange(4)

    moved = to_device([tensor], torch.device("cpu"))

    assert type(moved) is list and torch.equal(moved[0], tensor)


def test_to_device_hands_a_cpu_batch_of_tensors_back_as_it_is():
    """The CPU step's fast path: nothing to move, so the same tuple (what .to("cpu") gives
    for each tensor); a batch holding anything else still goes through the general path."""
    pair = (torch.ones(2), torch.arange(2))
    cpu = torch.device("cpu")

    assert to_device(pair, cpu) is pair
    assert to_device(pair[0], cpu) is pair[0]
    mixed = [torch.ones(2), "name"]
    moved = to_device(mixed, cpu)
    assert moved is not mixed and moved[0] is mixed[0] and moved[1] == "name"
    named = Pair(image=torch.ones(1), label=torch.zeros(1))
    assert type(to_device(named, cpu)) is Pair  # (a subclass of tuple: the general path)
    assert all(_is_meta(t) for t in to_device(pair, META)), "another device: moved"


@pytest.mark.parametrize("container", [tuple, list])
def test_split_batch_two_items_gives_inputs_and_target(container):
    inputs, target = torch.ones(3, 2), torch.tensor([0, 1, 0])

    got = split_batch(container([inputs, target]))

    assert got[0] is inputs and got[1] is target


def test_split_batch_three_tuple_points_to_step_fn():
    with pytest.raises(ConfigurationError) as info:
        split_batch((torch.ones(2), torch.ones(2), torch.ones(2)))

    message = str(info.value)
    assert "tuple of length 3" in message
    assert "(inputs, target)" in message
    assert "step_fn" in message


@pytest.mark.parametrize(
    ("batch", "kind"),
    [({"x": torch.ones(2), "y": torch.ones(2)}, "dict"), (torch.ones(2), "Tensor")],
)
def test_split_batch_other_layouts_point_to_step_fn(batch, kind):
    with pytest.raises(ConfigurationError, match=rf"got {kind}\. Pass step_fn="):
        split_batch(batch)


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        (torch.ones(5, 3), 5),
        (torch.tensor(2.0), 1),
        ((torch.ones(4, 2), torch.ones(4)), 4),
        ([torch.ones(6)], 6),
        ({"image": torch.ones(7, 3), "label": torch.ones(7)}, 7),
        (("id-0", 3, torch.ones(2, 9)), 2),
        ({"meta": {"ids": ["a", "b"]}, "nested": [(torch.ones(8),)]}, 8),
        (Pair(image=torch.ones(3, 2), label=torch.ones(3)), 3),
        ("no tensors", 0),
        ((), 0),
    ],
)
def test_batch_size_of_finds_first_tensor_length(batch, expected):
    assert batch_size_of(batch) == expected
