"""A stock Flower PyTorch task (the shape of Flower's quickstart-pytorch): a small CNN and the data
of one partition (scikit-learn's 8x8 digits, offline)."""

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    d = load_digits()
    x = torch.tensor(d.images[partition_id::num_partitions][:4] / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target[partition_id::num_partitions][:4], dtype=torch.long)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


def train(net: nn.Module, loader, epochs: int, lr: float) -> float:
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    total = 0.0
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            total += float(loss)
    return total / max(1, epochs * len(loader))


def test(net: nn.Module, loader) -> tuple[float, float]:
    net.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for x, y in loader:
            out = net(x)
            loss += float(nn.functional.cross_entropy(out, y))
            correct += int((out.argmax(1) == y).sum())
    return loss / len(loader), correct / len(loader.dataset)


_ = np
