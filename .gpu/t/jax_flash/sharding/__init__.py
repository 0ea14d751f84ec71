"""Many devices: sharding rules for the primitives, and ring attention."""
