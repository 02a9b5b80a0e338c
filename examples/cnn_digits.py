"""A CNN of your own on the 8×8 digits: its own DataLoader, SGD with momentum and a step
scheduler, under data parallelism with ZeRO-3 (each rank keeps 1/dp of the weights,
gradients and momenta). It trains, reports held-out accuracy, then checks itself against
one process with `meshtrain.verify`.

    torchrun --nproc-per-node=2 examples/cnn_digits.py
    meshtrain verify --model examples.cnn_digits:factory --dp 2 --zero 3 --data digits
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import meshtrain


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                                      nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.head(self.features(x.view(-1, 1, 8, 8)))


def make_model():
    torch.manual_seed(0)  # the same weights on every rank
    return CNN()


def sgd(named_params):
    return torch.optim.SGD((p for _, p in named_params), lr=0.05, momentum=0.9)


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)


def digits():
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    return x, torch.tensor(d.target)


def batch(step, batch_size):
    """The global batch of `step`: a pure function of the step (the command line's form)."""
    x, y = digits()
    rows = torch.randint(0, len(x), (batch_size,), generator=torch.Generator().manual_seed(step))
    return x[rows], y[rows]


def factory():
    return meshtrain.Recipe(make_model, batch=batch, loss_fn=F.cross_entropy, wrap=["features", "head"],
                            optimizer=sgd, lr_scheduler=step_lr)


def main(steps=120, batch_size=64):
    mesh = meshtrain.init()  # dp fills the world
    job = meshtrain.parallelize(make_model(), mesh, optimizer=sgd, loss_fn=F.cross_entropy, zero=3,
                                wrap=["features", "head"], lr_scheduler=step_lr, clip_grad_norm=1.0)
    x, y = digits()
    train, held_out = TensorDataset(x[:1500], y[:1500]), (x[1500:], y[1500:])
    # Every rank draws the same global batches (same generator); job.step takes its share.
    loader = DataLoader(train, batch_size=batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    done = 0
    while done < steps:
        for inputs, targets in loader:
            out = job.step(inputs, targets)
            done += 1
            if mesh.is_main and done % 20 == 0:
                print(f"step {done}: loss {out.loss:.4f}, lr {out.lr:.4f}, grad norm {out.grad_norm:.3f}")
            if done == steps:
                break
    accuracy = (job.forward(held_out[0]).argmax(-1) == held_out[1]).float().mean().item()
    report = meshtrain.verify(make_model, [batch(s, batch_size) for s in range(4)], mesh=mesh, optimizer=sgd,
                              loss_fn=F.cross_entropy, zero=3, wrap=["features", "head"], lr_scheduler=step_lr,
                              clip_grad_norm=1.0)
    if mesh.is_main:
        print(f"held-out accuracy {accuracy:.3f}")
        print(f"verify (dp={mesh.size('dp')}, ZeRO-3): {report}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    steps = [int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--steps=")]
    sys.exit(main(*steps))
