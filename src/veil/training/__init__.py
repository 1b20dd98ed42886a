"""Training: the defended client step, the training loop, checkpoints."""

from veil.training.step import StepResult, client_step, compute_loss, defended_backward, exported_grads

__all__ = ["StepResult", "client_step", "compute_loss", "defended_backward", "exported_grads"]
