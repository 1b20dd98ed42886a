"""A stock Flower ClientApp (quickstart-pytorch shape), untouched."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from task import Net, load_data
from task import test as test_fn
from task import train as train_fn

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    pid, n = context.node_config["partition-id"], context.node_config["num-partitions"]
    loader = load_data(pid, n, int(context.run_config.get("batch-size", 1)))
    loss = train_fn(model, loader, 1, float(msg.content["config"]["lr"]))
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(loader.dataset)})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    pid, n = context.node_config["partition-id"], context.node_config["num-partitions"]
    loader = load_data(pid, n, 8)
    loss, acc = test_fn(model, loader)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": acc, "num-examples": len(loader.dataset)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
