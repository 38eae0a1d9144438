"""A training script whose perf metrics are switched by its config: free when off, one line per step when on.

    python examples/config_train.py --config examples/config.yaml                              # off: NULL_SCOPE
    python examples/config_train.py --config examples/config.yaml debug.enable_perf_metrics=true
    STEPSCOPE=1 python examples/config_train.py --config examples/config.yaml               # the env wins

Overrides are dotted `key=value` words after the options, as in Hydra/OmegaConf command lines (values are YAML).
"""

from __future__ import annotations

import argparse

import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from stepscope import Scope
from stepscope.sinks import JsonlSink


def load_config(path: str, overrides: list[str]) -> dict:
    """The YAML file at ``path`` with ``a.b=value`` overrides applied (values parsed as YAML: true, 3, 0.1)."""
    with open(path) as f:
        config = yaml.safe_load(f)
    for override in overrides:
        key, _, value = override.partition("=")
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = parser.parse_args()
    config = load_config(args.config, args.overrides)
    train = config["train"]

    torch.manual_seed(0)
    samples = train["steps"] * train["batch_size"]
    data = TensorDataset(torch.randn(samples, 64), torch.randint(0, 10, (samples,)))
    loader = DataLoader(data, batch_size=train["batch_size"])
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=train["lr"])
    scope = Scope.from_config(config, warmup=5, sinks=[JsonlSink(config["debug"]["metrics_jsonl"])])
    for x, y in scope.data(loader):
        with scope.phase("forward"):
            loss = nn.functional.cross_entropy(model(x), y)
        with scope.phase("backward"):
            loss.backward()
        with scope.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scope.step(batch_size=x.shape[0])
    scope.close()
    print("perf metrics:", "on, " + config["debug"]["metrics_jsonl"] if scope.enabled else "off")
    scope.print_table()


if __name__ == "__main__":
    main()
