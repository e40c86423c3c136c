"""The Hydra config tree (`pkg://metaclaw.conf`): `train.yaml`, `serve.yaml` and their groups. Data, not code."""
