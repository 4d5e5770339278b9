"""Train a small byte-level language model on Python's own source with any data-parallel backend.

    python examples/lm.py                                            # one process (strategy "dp")
    torchrun --standalone --nproc_per_node 2 examples/lm.py          # DDP, 2 processes
    torchrun --standalone --nproc_per_node 2 examples/lm.py --strategy fsdp
    horovodrun -np 2 -H localhost:2 --gloo python examples/lm.py     # Horovod, 2 processes
    torchrun --standalone --nproc_per_node 4 examples/lm.py --model llama --tensor-parallel 2
    torchrun --standalone --nproc_per_node 2 examples/lm.py --pipeline-parallel 2

Data: the standard library's own ``.py`` files (``sysconfig.get_paths()["stdlib"]``), so there
is nothing to download. The public top-level modules (names not starting with ``_``: the
private ones are generated data or huge pure-Python fallbacks) are sorted by name and
``--files`` of them taken evenly spread over that list; every 4th of those is a validation
file, the rest train (a split by file: no validation line was seen in training). Each file is
cut at blank lines into blocks, and each block into samples of whole lines of at most
``--max-len`` bytes (a longer line is truncated). A sample is its bytes (tokens 0-255) after a
BOS token, padded to ``--max-len`` with a PAD token whose labels are -100: the samples, and so
the batches, hold very different numbers of real tokens.

The loss is token-exact: ``step_fn`` returns ``distkit.Loss(sum of the token cross-entropies,
number of labelled tokens)``, so the loss of a step is the mean over every token of the global
batch, and N processes with ``--batch-size b`` train like one with ``N * b`` whatever the
padding. The validation loss is the mean over every validation token of every rank; its exp is
the perplexity, printed beside that of a unigram model of the training bytes (add-one
smoothing), which knows byte frequencies and nothing else.

Model (``--model``): a ``transformers`` GPT-2 built from a config (2 layers, width 64, 4 heads;
no download), or without transformers (``auto``) or with ``--model torch`` a plain-torch causal
transformer of the same size, or with ``--model llama`` a ``transformers`` Llama of the same
size (2 key-value heads).

Tensor parallel (``--tensor-parallel T``, under ``--strategy fsdp``, the default then): each
layer the plan names is split over ``T`` consecutive ranks, and FSDP shards over the rest
(world = shard x T); ``--batch-size`` is then per data-parallel rank (a tensor-parallel group's
ranks see the same samples). The Llama is split by its own published plan
(``tensor_plan="auto"``); the plain-torch model by a plan of this script's (its feed-forward
``linear1`` colwise, ``linear2`` rowwise: its attention's fused ``in_proj_weight`` is no
``nn.Linear``); GPT-2 publishes none, and its ``Conv1D`` layers are no ``nn.Linear``: distkit
refuses it, naming the model.

Pipeline parallel (``--pipeline-parallel P``, under ``--strategy fsdp``; the plain-torch model):
the model in ``P`` stages on ``P`` blocks of ranks (world = P x shard x T), its transformer
blocks split evenly, the embeddings in the first stage and the norm and output layer in the
last; micro-batches of ``--batch-size / --microbatches`` rows flow through them (torch's 1F1B
schedule). The cut is a function of this script's (``pipeline_split=stages_of``): the model's
forward adds the position embeddings and builds the causal mask between its children, so
distkit cannot cut it by names. The loss is then ``loss_fn`` (the same token-exact
``distkit.Loss``, on the last stage), the batches ``(input_ids, labels)``.

The weights are saved with ``trainer.save_weights(--out)``
(``model.safetensors``, and ``config.json`` for GPT-2 and Llama, which
``AutoModelForCausalLM.from_pretrained(out)`` loads); rank 0 then loads them back into a fresh
model and samples a line from each of a few prompts.

The defaults (24 files: 581,247 training tokens in 18 files, 99,685 validation tokens in 6, on
CPython 3.11; AdamW at 5e-3 with cosine decay per step, batch 16 per process, 3 epochs) took the
validation perplexity to 5.84 (one process) and 6.25 (2 processes, global batch 32: half the
steps) against the unigram baseline's 21.70, in 54-73 s wall time under python, torchrun and
horovodrun on 2 shared CPU cores. One thread per process unless ``OMP_NUM_THREADS`` is set.
Needs ``safetensors`` (for the weights); ``transformers`` is optional.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import example_cli
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import distkit

BOS, PAD = 256, 257  # after the 256 byte values
VOCAB = 258
IGNORE = -100  # the label of a padding position: no loss, not counted
VAL_EVERY = 4  # every 4th selected file is a validation file
PROMPTS = (b"def ", b"import ", b"class ", b"    return ")
WIDTH, LAYERS, HEADS = 64, 2, 4
DTYPES = {"float32": torch.float32, "float64": torch.float64}
#: --compile: Trainer(compile=...)
COMPILE: dict[str, bool | str] = {"off": False, "model": True, "blocks": "blocks"}


# ------------------------------------------------------------------------------------ data
class CorpusError(ValueError):
    """The standard library folder does not hold the files asked for."""


def corpus_files(count: int, folder: str | Path | None = None) -> tuple[list[Path], list[Path]]:
    """``(train files, validation files)``: ``count`` public ``.py`` modules of ``folder``
    (default: this Python's standard library), evenly spread over their sorted names."""
    root = Path(folder if folder is not None else sysconfig.get_paths()["stdlib"])
    modules = sorted(p for p in root.glob("*.py") if not p.name.startswith("_") and p.is_file())
    if len(modules) < count:
        raise CorpusError(f"--files {count}: {root} holds only {len(modules)} public .py modules")
    chosen = [modules[i * len(modules) // count] for i in range(count)]
    val = [path for i, path in enumerate(chosen) if i % VAL_EVERY == VAL_EVERY - 1]
    return [path for path in chosen if path not in val], val


def samples_of(text: bytes, max_len: int) -> list[bytes]:
    """The file cut at blank lines into blocks, and each block into runs of whole lines of at
    most ``max_len`` bytes (newlines included; a longer line alone, truncated)."""
    found: list[bytes] = []
    for block in re.split(rb"\n[ \t]*\n", text):
        piece = b""
        for line in (block.strip(b"\n") + b"\n").splitlines(keepends=True):
            line = line[:max_len]  # a line longer than a sample is truncated
            if len(piece) + len(line) > max_len:
                found.append(piece)
                piece = b""
            piece += line
        found.append(piece)
    return [piece for piece in found if piece.strip()]


class ByteSequences(Dataset):
    """Byte samples as ``{"input_ids", "labels"}`` of length ``max_len``: ``input_ids`` is
    BOS + the bytes, ``labels`` the bytes (the next token at each position), both padded
    (PAD, and -100)."""

    def __init__(self, files: Sequence[Path], max_len: int, max_samples: int | None = None):
        pieces = [p for path in files for p in samples_of(path.read_bytes(), max_len)]
        pieces = pieces[:max_samples]
        self.input_ids = torch.full((len(pieces), max_len), PAD, dtype=torch.long)
        self.labels = torch.full((len(pieces), max_len), IGNORE, dtype=torch.long)
        for row, piece in enumerate(pieces):
            tokens = torch.tensor([BOS, *piece])
            self.input_ids[row, : len(piece)] = tokens[:-1]
            self.labels[row, : len(piece)] = tokens[1:]

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}

    def tokens(self) -> torch.Tensor:
        """Every labelled token, in order."""
        return self.labels[self.labels != IGNORE]


def unigram_perplexity(train: ByteSequences, val: ByteSequences) -> float:
    """The validation perplexity of the training bytes' frequencies, add-one smoothed over
    the 256 byte values (the only tokens ever labelled)."""
    counts = torch.bincount(train.tokens(), minlength=256).double() + 1.0
    log_p = (counts / counts.sum()).log()
    return math.exp(-log_p[val.tokens()].mean().item())


# ------------------------------------------------------------------------------------ models
class TinyCausalLM(nn.Module):
    """GPT-2's shape in plain torch: token + position embeddings, pre-norm causal blocks."""

    def __init__(self, vocab: int, max_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, WIDTH)
        self.positions = nn.Embedding(max_len, WIDTH)
        block = nn.TransformerEncoderLayer(
            WIDTH, HEADS, 4 * WIDTH, dropout=0.0, activation="gelu", batch_first=True,
            norm_first=True,
        )  # fmt: skip
        self.blocks = nn.TransformerEncoder(block, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, vocab, bias=False)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Next-token scores. ``attention_mask`` (GPT-2's argument) is not needed: the padding
        is on the right, and a causal model never attends to the right."""
        del attention_mask
        n = input_ids.shape[1]
        where = torch.arange(n, device=input_ids.device)
        x = self.tokens(input_ids) + self.positions(where)
        causal = nn.Transformer.generate_square_subsequent_mask(n, device=input_ids.device)
        return self.head(self.norm(self.blocks(x, mask=causal, is_causal=True)))


def pick_model(kind: str) -> str:
    """``hf``, ``llama`` or ``torch`` for ``--model``; ``auto`` is ``hf`` where transformers
    imports."""
    if kind != "auto":
        return kind
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "torch"
    return "hf"


def build_model(kind: str, max_len: int, layers: int = LAYERS) -> nn.Module:
    """A fresh causal LM over :data:`VOCAB` tokens (``kind``: ``hf`` or ``torch``); GPT-2
    with ``layers`` blocks (the plain torch model has its own two)."""
    if kind == "torch":
        return TinyCausalLM(VOCAB, max_len)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM  # optional: imported only here

        llama = LlamaConfig(
            vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH,
            num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,
            max_position_embeddings=max_len, bos_token_id=BOS, eos_token_id=BOS,
            pad_token_id=PAD, tie_word_embeddings=False, initializer_range=0.05, use_cache=False,
        )  # fmt: skip
        return LlamaForCausalLM(llama)
    from transformers import GPT2Config, GPT2LMHeadModel  # optional: imported only here

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=max_len, n_embd=WIDTH, n_layer=layers, n_head=HEADS,
        bos_token_id=BOS, eos_token_id=BOS, pad_token_id=PAD,
        # a few epochs over a small corpus: dropout would only slow it down
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        # GPT-2's 0.02 suits width 768; at width 64 it starts near-uniform and learns slowly
        initializer_range=0.05,
        # training and sample_line recompute every position: no key-value cache, which
        # GPT-2 would build in training too (and hand every block, each block's state a
        # guard that makes compile="blocks" compile every block anew)
        use_cache=False,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


class _FirstStage(nn.Module):
    """A pipeline's first stage of :class:`TinyCausalLM`: its embeddings and first blocks
    (the model's own modules)."""

    def __init__(self, model: TinyCausalLM, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.tokens, self.positions = model.tokens, model.positions
        self.blocks = nn.ModuleList(blocks)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        where = torch.arange(input_ids.shape[1], device=input_ids.device)
        return _run_blocks(self.blocks, self.tokens(input_ids) + self.positions(where))


class _LaterStage(nn.Module):
    """A later stage: its blocks, and in the last stage the norm and the output layer."""

    def __init__(self, blocks: Sequence[nn.Module], model: TinyCausalLM | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.norm = None if model is None else model.norm
        self.head = None if model is None else model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _run_blocks(self.blocks, x)
        if self.norm is None or self.head is None:
            return x
        return self.head(self.norm(x))


def _run_blocks(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """The blocks as ``nn.TransformerEncoder`` runs them: each on the causal mask."""
    causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
    for block in blocks:
        x = block(x, src_mask=causal, is_causal=True)
    return x


def stages_of(count: int) -> Any:
    """``pipeline_split`` for :class:`TinyCausalLM` in ``count`` stages: its blocks split
    evenly, in order (the earlier stages take one more where they do not divide)."""

    def cut(model: nn.Module) -> list[nn.Module]:
        assert isinstance(model, TinyCausalLM)
        blocks = list(model.blocks.layers)
        if count > len(blocks):
            raise ValueError(
                f"--pipeline-parallel {count}: the model has {len(blocks)} blocks, at most one "
                "stage each"
            )
        sizes = [len(blocks) // count + (i < len(blocks) % count) for i in range(count)]
        starts = [sum(sizes[:i]) for i in range(count)]
        parts = [blocks[a : a + n] for a, n in zip(starts, sizes, strict=True)]
        return [
            _FirstStage(model, parts[0]),
            *(_LaterStage(part, model if i == count - 1 else None) for i, part in
              enumerate(parts[1:], start=1)),
        ]  # fmt: skip

    return cut


class Pairs(Dataset):
    """A :class:`ByteSequences` as ``(input_ids, labels)`` pairs: a pipeline's batches (the
    first stage takes the inputs, the loss on the last stage the target)."""

    def __init__(self, sequences: ByteSequences) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sequences.input_ids[i], self.sequences.labels[i]


def pair_loss(logits: torch.Tensor, labels: torch.Tensor) -> distkit.Loss:
    """:func:`token_loss` as a ``loss_fn`` (under a pipeline): from the last stage's scores."""
    scores = logits.flatten(0, 1)
    total = F.cross_entropy(
        scores.to(torch.promote_types(scores.dtype, torch.float32)),
        labels.flatten(),
        ignore_index=IGNORE,
        reduction="sum",
    )
    return distkit.Loss(total, (labels != IGNORE).sum())


def logits_of(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``(batch, length, vocab)`` scores from either model (GPT-2 returns an output object)."""
    out = model(input_ids=input_ids, attention_mask=(input_ids != PAD).long())
    return out if isinstance(out, torch.Tensor) else out.logits


def token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> distkit.Loss:
    """The batch's summed next-token cross-entropy and its number of labelled tokens."""
    logits = logits_of(model, batch["input_ids"])
    labels = batch["labels"]
    scores = logits.flatten(0, 1)  # in float32 at least (bf16/fp16 under autocast)
    total = F.cross_entropy(
        scores.to(torch.promote_types(scores.dtype, torch.float32)),
        labels.flatten(),
        ignore_index=IGNORE,
        reduction="sum",
    )
    return distkit.Loss(total, (labels != IGNORE).sum(), output=logits)


class TokenAccuracy(distkit.Metric):
    """The share of labelled tokens whose most likely next token is the right one."""

    def batch_state(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        labels = target["labels"] if isinstance(target, dict) else target  # a pipeline's: labels
        labelled = labels != IGNORE
        hits = (output.argmax(dim=-1) == labels) & labelled
        return torch.stack([hits.sum(), labelled.sum()]).double()

    def state_shape(self) -> tuple[int, ...]:
        return (2,)

    def compute(self, state: torch.Tensor) -> float:
        hits, tokens = state.tolist()
        return hits / tokens if tokens else float("nan")


@torch.no_grad()
def sample_line(
    model: nn.Module, prompt: bytes, *, max_len: int, temperature: float, seed: int
) -> bytes:
    """The prompt continued to the end of its line (at most ``max_len`` bytes in all): bytes
    drawn at ``temperature`` from a generator seeded with ``seed`` (0: the most likely)."""
    generator = torch.Generator().manual_seed(seed)
    ids = [BOS, *prompt]
    while len(ids) <= max_len:
        scores = logits_of(model, torch.tensor([ids]))[0, -1, :256].float()  # bytes only
        if temperature > 0:
            probs = torch.softmax(scores / temperature, dim=0)
            token = int(torch.multinomial(probs, 1, generator=generator))
        else:
            token = int(scores.argmax())
        if token == ord("\n"):
            break
        ids.append(token)
    return bytes(ids[1:])


# ------------------------------------------------------------------------------------ the job
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--strategy", default="auto",
        help="auto (follows the launcher), ddp, dp, fsdp, horovod or apex (default: auto)",
    )  # fmt: skip
    parser.add_argument(
        "--model", default="auto", choices=["auto", "hf", "llama", "torch"],
        help="hf: transformers' GPT-2; llama: transformers' Llama; torch: plain torch; auto: "
        "hf when transformers imports",
    )  # fmt: skip
    parser.add_argument(
        "--tensor-parallel", type=int, default=1,
        help="ranks that split each layer (FSDPStrategy(tensor_parallel=...); default: 1)",
    )  # fmt: skip
    parser.add_argument(
        "--pipeline-parallel", type=int, default=1,
        help="pipeline stages (FSDPStrategy(pipeline_parallel=...), --model torch; default: 1)",
    )  # fmt: skip
    parser.add_argument(
        "--microbatches", type=int, default=None,
        help="a pipeline's micro-batches per batch (default: the stages)",
    )  # fmt: skip
    parser.add_argument("--epochs", type=int, default=3, help="(default: 3)")
    parser.add_argument(
        "--batch-size", type=int, default=16,
        help="per data-parallel rank: per process, but per tensor-parallel group (default: 16)",
    )  # fmt: skip
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument(
        "--lr", type=float, default=5e-3,
        help="AdamW's initial learning rate, decayed to zero per step (cosine; default: 5e-3)",
    )  # fmt: skip
    parser.add_argument("--precision", default="32", choices=["32", "bf16", "fp16"])
    parser.add_argument(
        "--dtype", default="float32", choices=sorted(DTYPES),
        help="the weights' dtype (default: float32); float64 makes runs on different process "
        "counts comparable to ~1e-12, what the tests check on any CPU",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compile", default="off", choices=sorted(COMPILE),
        help="torch.compile: off, model (the whole model) or blocks (each transformer block; "
        "one graph for all of them) (default: off)",
    )  # fmt: skip
    parser.add_argument(
        "--files", type=int, default=24,
        help="standard library modules to read, every 4th for validation (default: 24)",
    )  # fmt: skip
    parser.add_argument(
        "--max-samples", type=int, default=None,
        help="use at most this many train samples, and as many validation samples",
    )  # fmt: skip
    parser.add_argument(
        "--max-len", type=int, default=128, help="bytes per sample, at most (default: 128)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.7,
        help="sampling temperature of the generated lines, 0 for greedy (default: 0.7)",
    )  # fmt: skip
    parser.add_argument("--out", default="lm-out", help="the weights' folder (default: ./lm-out)")
    # the legacy `python -m torch.distributed.launch` passes --local_rank; distkit reads it itself
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "grad_accum", "max_samples", "tensor_parallel",
                 "pipeline_parallel", "microbatches"):  # fmt: skip
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.files < 2:
        parser.error(f"--files must be >= 2 (one to train on, one to validate), got {args.files}")
    if args.max_len < 8:
        parser.error(f"--max-len must be >= 8, got {args.max_len}")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.precision != "32" and args.dtype != "float32":
        parser.error(
            f"--precision {args.precision} needs --dtype float32 (autocast lowers float32 "
            f"only: {args.dtype} weights would train at full precision), got --dtype {args.dtype}"
        )
    if args.model in ("hf", "llama") and pick_model("auto") != "hf":
        parser.error(
            f"--model {args.model} needs transformers (pip install transformers); or --model torch"
        )
    if args.pipeline_parallel > 1 and args.model not in ("auto", "torch"):
        parser.error(
            f"--pipeline-parallel {args.pipeline_parallel} cuts --model torch into stages (a "
            "function of this script's); a transformers model computes its masks and rotary "
            f"embeddings between its layers: write a pipeline_split function for --model "
            f"{args.model}, or use --tensor-parallel"
        )
    if args.pipeline_parallel > 1:
        args.model = "torch"
    if max(args.tensor_parallel, args.pipeline_parallel) > 1 and args.strategy not in (
        "auto",
        "fsdp",
    ):
        option = (
            f"--tensor-parallel {args.tensor_parallel}"
            if args.tensor_parallel > 1
            else f"--pipeline-parallel {args.pipeline_parallel}"
        )
        parser.error(
            f"{option} runs under --strategy fsdp (tensor and pipeline parallelism inside "
            f"sharded data parallelism), got --strategy {args.strategy}"
        )
    if args.microbatches is not None and args.pipeline_parallel == 1:
        parser.error("--microbatches configures a pipeline: add --pipeline-parallel P")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # One thread per process, launcher or not, unless OMP_NUM_THREADS says otherwise: a model
    # this narrow gains little from intra-op threads, and where the cores are busy they cost
    # ~8x (700 ms a step against 82 ms, one process on 2 loaded cores).
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    kind = pick_model(args.model)
    torch.manual_seed(args.seed)  # every rank builds the same initial weights
    model = build_model(kind, args.max_len).to(DTYPES[args.dtype])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    trainer = distkit.Trainer(
        # fsdp's default units keep GPT-2's tied embedding and output layer in one unit (the
        # root) and shard each transformer block
        strategy=pick_strategy(args.strategy, kind, args.tensor_parallel, args),
        max_epochs=args.epochs,
        batch_size=args.batch_size,
        precision=args.precision,
        grad_accum_steps=args.grad_accum,
        seed=args.seed,
        scheduler_interval="step",
        compile=COMPILE[args.compile],
    )
    with trainer:  # closing tears down the process group distkit created
        return train(trainer, model, optimizer, kind, args)


#: --model torch's plan: the feed-forward layers of each block (the attention's fused input
#: projection is a bare parameter, no nn.Linear: it stays whole)
TORCH_PLAN = {"blocks.layers.*.linear1": "colwise", "blocks.layers.*.linear2": "rowwise"}


def pick_strategy(
    name: str, kind: str, tensor_parallel: int, args: argparse.Namespace | None = None
) -> str | distkit.Strategy:
    """``--strategy``, or with ``--tensor-parallel`` > 1 fsdp with the model's plan: its own
    (``"auto"``: the Llama's; GPT-2 has none, which distkit refuses) or TORCH_PLAN; with
    ``--pipeline-parallel`` > 1 fsdp with the stages of :func:`stages_of`."""
    pipeline = 1 if args is None else args.pipeline_parallel
    if tensor_parallel == 1 and pipeline == 1:
        return name
    layout: dict[str, Any] = {}
    if tensor_parallel > 1:
        plan: Any = TORCH_PLAN if kind == "torch" else "auto"
        layout = {"tensor_parallel": tensor_parallel, "tensor_plan": plan}
    if pipeline > 1:
        assert args is not None
        layout |= {"pipeline_parallel": pipeline, "pipeline_split": stages_of(pipeline),
                   "microbatches": args.microbatches}  # fmt: skip
    return distkit.FSDPStrategy(**layout)


def mfu_text(record: dict[str, float]) -> str:
    """ ", MFU 41.2%" from an epoch record ("" where the device's peak is not known)."""
    if "mfu" not in record:
        return ""
    share = record["mfu"]
    return f", MFU {share:.1%}" if share >= 1e-3 else f", MFU {100 * share:.3g}%"


def train(
    trainer: distkit.Trainer,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    kind: str,
    args: argparse.Namespace,
) -> int:
    """Read the corpus, fit, compare with the unigram model, save, sample; the exit status."""
    failure: Exception | None = None
    try:  # every rank reads the (local) files itself
        train_files, val_files = corpus_files(args.files)
        train_set = ByteSequences(train_files, args.max_len, args.max_samples)
        val_set = ByteSequences(val_files, args.max_len, args.max_samples)
    except (OSError, CorpusError) as exc:
        failure = exc
    main_failed, any_failed = example_cli.agree_on_failure(trainer, failure)
    if any_failed:  # every rank stops here, none waits for the others
        if failure is not None and (trainer.is_main or not main_failed):
            where = "" if trainer.is_main else f"rank {trainer.rank}: "
            print(f"error: {where}{failure}", file=sys.stderr, flush=True)
        return 2
    global_batch = trainer.data_world_size * args.batch_size
    per_epoch = math.ceil(math.ceil(len(train_set) / global_batch) / args.grad_accum)
    schedule = example_cli.cosine(args.epochs * per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    baseline = unigram_perplexity(train_set, val_set)
    if trainer.is_main:
        names = ", ".join(path.stem for path in val_files)
        print(
            f"data: {len(train_files)} train files, {len(train_set):,} samples, "
            f"{len(train_set.tokens()):,} tokens; {len(val_files)} validation files ({names}), "
            f"{len(val_set):,} samples, {len(val_set.tokens()):,} tokens",
            flush=True,
        )
        params = sum(p.numel() for p in model.parameters())
        print(
            f"training a {type(model).__name__} ({params:,} parameters): "
            f"strategy={trainer.strategy.name}, world_size={trainer.world_size}"
            f"{split_text(trainer, args.tensor_parallel, args.pipeline_parallel)}, batch "
            f"{args.batch_size} per "
            f"data-parallel rank, {args.epochs} epoch(s) of {per_epoch} steps, "
            f"AdamW lr {args.lr:g} with cosine decay",
            flush=True,
        )
    start = time.perf_counter()
    if args.pipeline_parallel > 1:  # the schedule runs the model: a loss_fn, (inputs, target)
        how: dict[str, Any] = {"loss_fn": pair_loss}
        train_data, val_data = Pairs(train_set), Pairs(val_set)
    else:
        how, train_data, val_data = {"step_fn": token_loss}, train_set, val_set
    result = trainer.fit(
        model,
        optimizer,
        train_data,
        **how,
        val_data=val_data,
        metrics={"token_acc": TokenAccuracy()},
        scheduler=scheduler,
    )
    seconds = time.perf_counter() - start
    last = result.history[-1]
    if example_cli.diverged(last["train_loss"], args.lr, is_main=trainer.is_main):
        return 1
    out = Path(args.out)
    trainer.save_weights(out)  # every rank: a collective (fsdp gathers the shards)
    if trainer.is_main:
        perplexity = math.exp(last["val_loss"])
        print(
            f"val perplexity: {perplexity:.2f} (unigram baseline: {baseline:.2f})  "
            f"val token accuracy: {last['val_token_acc']:.4f}  "
            f"train loss: {last['train_loss']:.4f}  "
            f"({len(result.history)} epoch(s) in {seconds:.1f} s; last epoch "
            f"{last['tokens_per_s']:,.0f} tokens/s{mfu_text(last)})",
            flush=True,
        )
        print(f"weights: {out / 'model.safetensors'}", flush=True)
        show_samples(kind, out, args)
    return 0


def split_text(trainer: distkit.Trainer, tensor_parallel: int, pipeline: int = 1) -> str:
    """ " (2 data-parallel x tensor_parallel 2)" under tensor parallelism (with
    " x pipeline_parallel 2" under a pipeline), else ""."""
    if tensor_parallel == 1 and pipeline == 1:
        return ""
    words = [f"{trainer.data_world_size} data-parallel"]
    if tensor_parallel > 1:
        words.append(f"tensor_parallel {tensor_parallel}")
    if pipeline > 1:
        words.append(f"pipeline_parallel {pipeline}")
    return f" ({' x '.join(words)})"


def show_samples(kind: str, out: Path, args: argparse.Namespace) -> None:
    """Rank 0: the saved weights loaded back into a fresh model, and a line from each prompt."""
    if kind in ("hf", "llama"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out)
        print(f"AutoModelForCausalLM.from_pretrained({str(out)!r}) loads it", flush=True)
    else:
        model = build_model(kind, args.max_len).to(DTYPES[args.dtype])
        distkit.load_weights(model, out)
        print(f"distkit.load_weights(model, {str(out)!r}) loads it", flush=True)
    model.eval()
    how = f"temperature {args.temperature:g}" if args.temperature > 0 else "greedy"
    print(f"samples ({how}, seed {args.seed}):")
    for i, prompt in enumerate(PROMPTS):
        line = sample_line(
            model, prompt, max_len=args.max_len, temperature=args.temperature, seed=args.seed + i
        )
        print(f"  {line.decode('utf-8', errors='replace')}", flush=True)


if __name__ == "__main__":
    sys.exit(example_cli.run(main))
