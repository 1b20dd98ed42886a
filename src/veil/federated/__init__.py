"""Federated and split learning on Flower (Message API, 1.42).

  fedavg/   FedAvg / FedProx / FedSGD: `task` (model, data, local training), `client_app`,
            `server_app` (the round loop, checkpoints, the live auditor), `config`, `dp`,
            `runner` (`federate`), `auditor`, `audit` (protocol scenarios), `plots`
  split/    SL / FeSTA / p-FeSTA: `spec` (the run spec, at the bottom), `models`, `multitask`,
            `client_app`, `server_app`, `run`, `compare`, `comm` (the paper's costs), `audit`,
            `feature_audit`

Shared by both: `client_secret` (entropy the server never sees), `comm` (bytes on the wire),
`grid` (the in-process grid and Ray simulation), `sections` (the extra config sections).
"""
