"""FedAvg / FedProx / FedSGD on Flower: ClientApp, ServerApp, the live privacy auditor."""
