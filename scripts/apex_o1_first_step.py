"""On a GPU with legacy NVIDIA apex (25.04): does a hand-written O1 loop, without distkit, also
overflow at its first step on the workload of test_real_apex_trains_like_ddp, as distkit's O1 fit
did on an H200 (docs/gpu.md, run 3)? Prints each step's loss, largest gradient and loss scale.

    PYTHONPATH=/tmp/apex-25.04:$PWD python3 scripts/apex_o1_first_step.py plain|upcast

scripts/gpu_check.sh runs it after the legacy apex tests. ``upcast``: the loss on float32
logits.
"""

import sys

import torch
import torch.nn.functional as F
from apex import amp

from tests.support.workloads import make_dataset, make_mlp

upcast = sys.argv[1] == "upcast"  # the loss on float32 logits
model = make_mlp().cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
data = make_dataset(64)
loader = torch.utils.data.DataLoader(
    data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3)
)
for epoch in range(2):
    for step, (x, y) in enumerate(loader):
        x, y = x.cuda(), y.cuda()
        out = model(x)
        loss = F.cross_entropy(out.float() if upcast else out, y)
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        grads = max(p.grad.abs().max().item() for p in model.parameters())
        scale = amp._amp_state.loss_scalers[0].loss_scale()
        print(f"epoch {epoch} step {step}: out {out.dtype} loss {loss.item():.4f}"
              f" max|grad| {grads:.3g} scale {scale}", flush=True)  # fmt: skip
        opt.step()
