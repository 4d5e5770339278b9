"""Metrics: hand-computed values, and sums of per-rank states equal the whole-dataset value."""

from __future__ import annotations

import math

import pytest
import torch

from distkit.metrics import Accuracy, ConfusionMatrix, MeanIoU

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")

# Scores for 4 samples over 3 classes; per row the classes ranked best to worst are:
#   sample 0: 2, 1, 0    sample 1: 0, 2, 1    sample 2: 1, 0, 2    sample 3: 2, 0, 1
SCORES = torch.tensor(
    [
        [0.1, 0.3, 0.6],
        [0.7, 0.1, 0.2],
        [0.3, 0.6, 0.1],
        [0.3, 0.1, 0.6],
    ]
)
TARGETS = torch.tensor([2, 1, 0, 1])  # top-1 hits: 0; top-2 hits: 0, 2; top-3: all


def _compute(metric, output, target):
    metric.update(output, target)
    return metric.compute(metric.state(CPU))


@pytest.mark.parametrize(("top_k", "expected"), [(1, 1 / 4), (2, 2 / 4), (3, 4 / 4)])
def test_accuracy_top_k_matches_hand_count(top_k, expected):
    assert _compute(Accuracy(top_k=top_k), SCORES, TARGETS) == pytest.approx(expected)


def test_accuracy_ignore_index_leaves_samples_out():
    targets = torch.tensor([2, -100, 1, -100])  # the two counted samples are both hits

    assert _compute(Accuracy(ignore_index=-100), SCORES, targets) == pytest.approx(1.0)
    metric = Accuracy(ignore_index=-100)
    metric.update(SCORES, targets)
    assert metric.state(CPU).tolist() == [2.0, 2.0]


def test_accuracy_per_pixel_with_ignore_index():
    # (N=1, C=2, H=2, W=2) scores; predictions [[0, 1], [1, 0]].
    scores = torch.tensor([[[[0.9, 0.2], [0.1, 0.8]], [[0.1, 0.8], [0.9, 0.2]]]])
    target = torch.tensor([[[0, 0], [1, 255]]])  # hit, miss, hit, ignored

    assert _compute(Accuracy(ignore_index=255), scores, target) == pytest.approx(2 / 3)


def test_accuracy_accumulates_over_batches():
    metric = Accuracy()
    metric.update(SCORES[:2], TARGETS[:2])
    metric.update(SCORES[2:], TARGETS[2:])

    assert metric.state(CPU).tolist() == [1.0, 4.0]
    assert metric.compute(metric.state(CPU)) == pytest.approx(0.25)


def test_accuracy_with_nothing_counted_is_nan():
    assert math.isnan(Accuracy().compute(torch.zeros(2, dtype=torch.float64)))


def test_accuracy_rejects_top_k_below_one():
    with pytest.raises(ValueError, match="top_k must be >= 1, got 0"):
        Accuracy(top_k=0)


# Labels: target [0, 0, 0, 1, 1, 2], prediction [0, 0, 1, 1, 2, 2] with 4 classes.
#   class 0: tp 2, union 3 + 2 - 2 = 3 -> 2/3
#   class 1: tp 1, union 2 + 2 - 1 = 3 -> 1/3
#   class 2: tp 1, union 1 + 2 - 1 = 2 -> 1/2
#   class 3: absent from both -> left out (counting it as 0 would give 0.375)
# miou = (2/3 + 1/3 + 1/2) / 3 = 0.5, pixel_acc = 4 / 6
SEG_TARGET = torch.tensor([[0, 0, 0], [1, 1, 2]])
SEG_PRED = torch.tensor([[0, 0, 1], [1, 2, 2]])


def _one_hot_scores(pred, num_classes):
    return torch.nn.functional.one_hot(pred, num_classes).movedim(-1, 1).float()


def test_confusion_matrix_counts_rows_target_columns_prediction():
    metric = ConfusionMatrix(num_classes=4)
    metric.update(SEG_PRED, SEG_TARGET)

    expected = [[2, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
    assert metric.state(CPU).tolist() == expected
    assert metric.compute(metric.state(CPU)) == {"matrix_total": 6.0}


@pytest.mark.parametrize("as_scores", [False, True], ids=["labels", "scores"])
def test_mean_iou_matches_hand_computed_values(as_scores):
    output = _one_hot_scores(SEG_PRED, 4) if as_scores else SEG_PRED

    result = _compute(MeanIoU(num_classes=4), output, SEG_TARGET)

    assert result["miou"] == pytest.approx(0.5)
    assert result["pixel_acc"] == pytest.approx(4 / 6)


def test_mean_iou_ignore_index_pixels_not_counted():
    target = torch.tensor([[0, 0, 0, 255], [1, 1, 2, 255]])
    pred = torch.tensor([[0, 0, 1, 3], [1, 2, 2, 0]])  # wrong guesses on the ignored pixels

    metric = MeanIoU(num_classes=4, ignore_index=255)
    result = _compute(metric, pred, target)

    assert metric.state(CPU).sum().item() == 6
    assert result["miou"] == pytest.approx(0.5)
    assert result["pixel_acc"] == pytest.approx(4 / 6)


def test_mean_iou_in_range_ignore_index_not_counted():
    # ignore_index may be a real class id; its pixels drop out of rows and of the total.
    target = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3])
    pred = torch.tensor([0, 0, 1, 1, 2, 2, 0, 3])

    result = _compute(MeanIoU(num_classes=4, ignore_index=3), pred, target)

    assert result["miou"] == pytest.approx(0.5)
    assert result["pixel_acc"] == pytest.approx(4 / 6)


def test_mean_iou_with_no_pixels_is_nan():
    result = MeanIoU(num_classes=3).compute(torch.zeros(3, 3, dtype=torch.float64))

    assert math.isnan(result["miou"]) and math.isnan(result["pixel_acc"])


def _random_classification(n, classes, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, classes, generator=gen), torch.randint(0, classes, (n,), generator=gen)


def _random_segmentation(n, classes, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, classes, 5, 6, generator=gen)
    target = torch.randint(0, classes, (n, 5, 6), generator=gen)
    target[:, 0, :2] = 255
    return scores, target


@pytest.mark.parametrize(
    ("make_metric", "make_data"),
    [
        (lambda: Accuracy(), lambda: _random_classification(37, 5, 0)),
        (lambda: Accuracy(top_k=3), lambda: _random_classification(37, 5, 1)),
        (lambda: Accuracy(ignore_index=255), lambda: _random_segmentation(9, 4, 2)),
        (lambda: MeanIoU(num_classes=4, ignore_index=255), lambda: _random_segmentation(9, 4, 3)),
    ],
    ids=["top1", "top3", "pixel-accuracy", "miou"],
)
def test_metric_summed_state_of_halves_equals_whole(make_metric, make_data):
    output, target = make_data()
    half = len(target) // 2
    whole, first, second = make_metric(), make_metric(), make_metric()
    whole.update(output, target)
    first.update(output[:half], target[:half])
    second.update(output[half:], target[half:])

    summed = first.state(CPU) + second.state(CPU)

    assert torch.equal(summed, whole.state(CPU))
    assert first.compute(summed) == pytest.approx(whole.compute(whole.state(CPU)))


@pytest.mark.parametrize(
    ("metric", "shape"),
    [(Accuracy(), (2,)), (ConfusionMatrix(num_classes=3), (3, 3)), (MeanIoU(5), (5, 5))],
)
def test_metric_state_without_batches_is_zeros_of_state_shape(metric, shape):
    state = metric.state(CPU)

    assert metric.state_shape() == shape
    assert state.shape == shape and state.dtype == torch.float64
    assert not state.any()


def test_metric_state_shape_matches_batch_state():
    output, target = _random_segmentation(2, 4, 4)
    for metric in (Accuracy(ignore_index=255), MeanIoU(num_classes=4)):
        assert metric.batch_state(output, target).shape == metric.state_shape()


def test_metric_reset_clears_state():
    metric = MeanIoU(num_classes=4)
    metric.update(SEG_PRED, SEG_TARGET)
    assert metric.state(CPU).sum().item() == 6

    metric.reset()

    assert not metric.state(CPU).any()
    metric.update(SEG_PRED[:1], SEG_TARGET[:1])
    assert metric.state(CPU).sum().item() == 3


def test_metric_update_does_not_track_gradients():
    scores = SCORES.clone().requires_grad_()
    metric = Accuracy()
    metric.update(scores, TARGETS)

    assert not metric.state(CPU).requires_grad


@pytest.mark.parametrize("num_classes", [0, 1])
def test_confusion_matrix_rejects_fewer_than_two_classes(num_classes):
    with pytest.raises(ValueError, match=f"num_classes must be >= 2, got {num_classes}"):
        MeanIoU(num_classes=num_classes)
