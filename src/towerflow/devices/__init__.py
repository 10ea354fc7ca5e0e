"""towerflow.devices (under construction)."""
