"""A stock Flower ServerApp (quickstart-pytorch shape); the two lines marked `veil` are all it changes."""

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from task import Net

from veil.flower import audited  # veil

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    num_rounds = int(context.run_config.get("num-server-rounds", 2))
    lr = float(context.run_config.get("lr", 0.1))
    arrays = ArrayRecord(Net().state_dict())
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=1.0, min_available_nodes=2)
    strategy = audited(
        strategy,
        model=Net(),
        attacks=[{"name": "ig", "iterations": 30}, "labels"],
        out=context.run_config.get("audit-dir", "veil-audit"),
        input_shape=(1, 8, 8),
        batch_size=4,
        clients=2,
    )  # veil
    strategy.start(grid=grid, initial_arrays=arrays, train_config=ConfigRecord({"lr": lr}), num_rounds=num_rounds)
