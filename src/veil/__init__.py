"""veil: train Transformers with privacy defenses in federated and split learning, and audit them."""

__version__ = "0.1.0"
