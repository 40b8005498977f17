"""Does this board's torch run EdgeFleet's local work? Prints one JSON line; exit 0 if so.

What a ClientApp does with torch, on a model shaped like EdgeFleet's SmallCNN: convolution
forward and backward, an SGD step, a matrix product (the BLAS), per-sample gradients with
torch.func (CA-HFP's curvature scores) and a Torch-Pruning dependency graph. Run it with the
venv's python; install.sh does, so that a torch build that needs a newer CPU than the board
has fails here (SIGILL, exit code 132 from the shell) and not in the first training round.
"""

from __future__ import annotations

import json
import platform
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402  (the import alone crashes some builds on ARMv8.0)
from torch import nn  # noqa: E402
from torch.func import functional_call, grad, vmap  # noqa: E402

t_import = time.perf_counter() - t0
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(
    nn.Conv2d(1, 8, 3, padding=1),
    nn.ReLU(),
    nn.MaxPool2d(2),
    nn.Conv2d(8, 16, 3, padding=1),
    nn.ReLU(),
    nn.MaxPool2d(2),
    nn.Flatten(),
    nn.Linear(16 * 7 * 7, 32),
    nn.ReLU(),
    nn.Linear(32, 10),
)
x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
t1 = time.perf_counter()
loss = nn.functional.cross_entropy(model(x), y)
opt.zero_grad()
loss.backward()
opt.step()
t_step = time.perf_counter() - t1
after = nn.functional.cross_entropy(model(x), y)

a = torch.randn(128, 128)
matmul_ok = bool(torch.allclose((a @ torch.eye(128)), a))

params = {k: v.detach() for k, v in model.named_parameters()}


def sample_loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
    out = functional_call(model, p, (xi[None],))
    return nn.functional.cross_entropy(out, yi[None])


per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
per_sample_ok = all(g.shape[0] == len(x) for g in per_sample.values())

import torch_pruning as tp  # noqa: E402

graph = tp.DependencyGraph().build_dependency(model, example_inputs=x[:1])
group = graph.get_pruning_group(model[0], tp.prune_conv_out_channels, idxs=[0, 1, 2, 3])
group.prune()
pruned_out = model(x).shape

ok = bool(torch.isfinite(loss) and torch.isfinite(after)) and matmul_ok and per_sample_ok
ok = ok and model[0].out_channels == 4 and tuple(pruned_out) == (8, 10)
print(
    json.dumps(
        {
            "ok": ok,
            "torch": torch.__version__,
            "cuda_build": torch.version.cuda,
            "torch_pruning": tp.__version__,
            "machine": platform.machine(),
            "python": platform.python_version(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "import_s": round(t_import, 2),
            "sgd_step_s": round(t_step, 3),
            "loss_before": round(loss.item(), 4),
            "loss_after": round(after.item(), 4),
        }
    )
)
sys.exit(0 if ok else 1)
