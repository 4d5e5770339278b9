"""Time a save blocks training: blocking vs background (``rt.save(..., blocking=False)``),
for a model state of 100 MB and 1 GB, at 1 and 2 ranks, to a local folder and to S3.

Each configuration sets up a model of that many fp32 bytes (``ddp``; 2 ranks under torchrun,
gloo) and saves it ``--saves`` times through ``rt.save``. **Blocked** is the time the call
holds the loop: for a blocking save the whole write (gathered on rank 0, written, checked,
renamed or uploaded; every rank waits for it), for a background one the staging (every tensor
copied off the training tensors) and the hand-off to rank 0's writer thread. **Persist** is
the background save's time until its file is complete (``handle.wait()`` right after the
call: the time a save interval must exceed for the next save not to wait). Between two saves
the weights change (an in-place update), as training changes them. Each figure is the median
over the saves of the slowest rank.

S3 is moto's server on loopback (``moto[server]``, the same endpoint the tests use), reached by
s3fs as any S3 endpoint through ``AWS_ENDPOINT_URL``; its speed is loopback HTTP into an
in-memory store, not a cloud's: the ratios are the point, not the absolute times.

    python benchmarks/checkpoints.py     # the table in docs/checkpoints.md (~6 min on 2 cores)
    python benchmarks/checkpoints.py --sizes 100 --ranks 1 --stores local --saves 2

Writes benchmarks/results/checkpoints.json: ``{"meta": {...}, "rows": [{"size_mb", "ranks",
"store", "sync_blocked_s", "async_blocked_s", "async_persist_s", "ratio"}]}`` (ratio: the
background save's blocked time over the blocking one's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results"
#: each parameter tensor's size (fp32 elements): 25 MB
CHUNK = 25 * 1024 * 1024 // 4


def make_model(size_mb: int) -> nn.Module:
    count = max(1, size_mb * 1024 * 1024 // 4 // CHUNK)
    model = nn.Module()
    model.chunks = nn.ParameterList(nn.Parameter(torch.randn(CHUNK)) for _ in range(count))
    return model


def worker(args: argparse.Namespace) -> None:
    import distkit

    torch.set_num_threads(1)
    with distkit.Runtime("ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "auto") as rt:
        model = rt.setup(make_model(args.size_mb))
        times: dict[str, list[float]] = {"sync": [], "async": [], "persist": []}
        for index in range(args.saves):
            for mode in ("sync", "async"):
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(1e-3)  # training changed the weights since the last save
                path = f"{args.where}/{mode}-{index}.pt"
                rt.barrier()
                started = time.perf_counter()
                handle = rt.save(path, {"model": model}, blocking=mode == "sync")
                times[mode].append(time.perf_counter() - started)
                if handle is not None:
                    handle.wait()
                    times["persist"].append(time.perf_counter() - started)
        medians = torch.tensor([statistics.median(times[k]) for k in ("sync", "async", "persist")])
        slowest = rt.all_gather(medians.reshape(1, -1)).reshape(-1, 3).amax(dim=0).tolist()
        if rt.is_main:
            keys = ("sync_blocked_s", "async_blocked_s", "async_persist_s")
            args.out.write_text(json.dumps(dict(zip(keys, slowest, strict=True))))


def launch(args: argparse.Namespace, size_mb: int, ranks: int, where: str, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        script = [__file__, "--worker", "--size-mb", str(size_mb), "--where", where,
                  "--out", str(out), "--saves", str(args.saves)]  # fmt: skip
        torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        cmd = [sys.executable, *(torchrun if ranks > 1 else []), *script]
        env = {**os.environ, **env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{size_mb} MB x{ranks} to {where} failed:\n{proc.stderr[-3000:]}")
        return dict(json.loads(out.read_text()))


@contextlib.contextmanager
def s3_on_loopback() -> Iterator[tuple[str, dict[str, str]]]:
    """moto's S3 server on a free loopback port: a new bucket's URL, and the environment
    that reaches it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("moto's server did not start: pip install 'moto[server]'")
            time.sleep(0.1)
        import s3fs

        bucket = f"bench-{secrets.token_hex(4)}"
        fs = s3fs.S3FileSystem(key="bench", secret="bench", endpoint_url=env["AWS_ENDPOINT_URL"])
        fs.mkdir(bucket)
        yield f"s3://{bucket}", env
    finally:
        server.terminate()
        server.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size-mb", type=int, default=100, help=argparse.SUPPRESS)
    parser.add_argument("--where", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000], help="MB of state")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--stores", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    parser.add_argument("--saves", type=int, default=3, help="saves per mode (median)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where checkpoints.json goes")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    rows = []
    print("| state | ranks | store | blocking: blocked s | background: blocked s | "
          "background: persist s | blocked ratio |")  # fmt: skip
    print("|--:|--:|---|--:|--:|--:|--:|")
    with contextlib.ExitStack() as stack:
        local = stack.enter_context(tempfile.TemporaryDirectory(prefix="distkit-bench-"))
        s3 = stack.enter_context(s3_on_loopback()) if "s3" in args.stores else None
        for size in args.sizes:
            for ranks in args.ranks:
                for store in args.stores:
                    if store == "s3":
                        assert s3 is not None
                        where, env = f"{s3[0]}/{size}-{ranks}", s3[1]
                    else:
                        where, env = f"{local}/{size}-{ranks}", {}
                    got = launch(args, size, ranks, where, env)
                    ratio = got["async_blocked_s"] / got["sync_blocked_s"]
                    rows.append({"size_mb": size, "ranks": ranks, "store": store, **got,
                                 "ratio": ratio})  # fmt: skip
                    print(f"| {size} MB | {ranks} | {store} | {got['sync_blocked_s']:.3f} | "
                          f"{got['async_blocked_s']:.3f} | {got['async_persist_s']:.3f} | "
                          f"{ratio:.1%} |", flush=True)  # fmt: skip
    args.results.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "saves": args.saves, "cpus": os.cpu_count()}
    (args.results / "checkpoints.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
