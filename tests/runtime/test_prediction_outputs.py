"""A batch's output as one value per sample: checked, moved to the CPU, split along dim 0, and
made plain for a file (pure, one process)."""

from __future__ import annotations

import collections

import pytest
import torch

from distkit.errors import ConfigurationError
from distkit.runtime._outputs import batch_to_cpu, plain, split_batch_output

pytestmark = pytest.mark.timeout(60)


def test_a_nested_output_splits_element_wise_keeping_its_containers():
    pair = collections.namedtuple("pair", "a b")
    logits = torch.arange(12.0).reshape(4, 3)
    output = {"pair": pair(logits, logits[:, 0]), "seq": [logits, logits * 2], "text": list("wxyz")}
    samples = split_batch_output(batch_to_cpu(output, 4), 4)
    assert len(samples) == 4
    third = samples[2]
    assert isinstance(third["pair"], pair) and torch.equal(third["pair"].a, logits[2])
    assert torch.equal(third["pair"].b, logits[2, 0])
    assert isinstance(third["seq"], list) and torch.equal(third["seq"][1], logits[2] * 2)
    assert third["text"] == "y"


def test_an_output_that_views_a_larger_tensor_is_copied_to_its_own_values():
    big = torch.randn(4, 1000)
    moved = batch_to_cpu(big[:, :2], 4)
    assert moved.untyped_storage().nbytes() == 4 * 2 * 4
    assert torch.equal(moved, big[:, :2])


def test_a_transformers_model_output_keeps_its_type_and_becomes_a_dict_in_a_file():
    outputs = pytest.importorskip("transformers.modeling_outputs")
    logits = torch.randn(3, 2)
    output = outputs.SequenceClassifierOutput(logits=logits)
    samples = split_batch_output(batch_to_cpu(output, 3), 3)
    assert [type(s) for s in samples] == [outputs.SequenceClassifierOutput] * 3
    assert torch.equal(samples[1].logits, logits[1]) and list(samples[1].keys()) == ["logits"]
    flat = plain(batch_to_cpu(output, 3))
    assert type(flat) is dict and torch.equal(flat["logits"], logits)


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (torch.tensor(1.0), "shape ()"),
        (torch.zeros(3, 2), "shape (3, 2)"),
        ({"x": torch.zeros(2), "n": 2}, "output['n'] is a int"),
        ((torch.zeros(2), "label"), "output[1] is a str"),
        ([torch.zeros(2), torch.zeros(3)], "output[1] is a tensor of shape (3,)"),
        (["a", "b", "c"], "a list of 3 items"),
        ((), "holds no value per sample"),
        (None, "returned None"),
    ],
)
def test_an_output_that_is_not_one_value_per_sample_is_refused_saying_where(output, message):
    with pytest.raises(ConfigurationError) as caught:
        batch_to_cpu(output, 2)
    assert message in str(caught.value)
