"""tokentape on Ray core: gateway actors that own their sessions, a session directory, store
shards gathered on export, and a trajectory queue for a trainer in the same cluster.
Needs the optional dependency: `pip install -e '.[ray]'` in a clone of the repository."""

from tokentape.ray.cluster import (
    Cluster,
    TrajectoryReader,
    connect,
    front_app,
    start_cluster,
    trajectories,
)
from tokentape.served import RayOptions, ServeSpec

__all__ = [
    "Cluster",
    "RayOptions",
    "ServeSpec",
    "TrajectoryReader",
    "connect",
    "front_app",
    "start_cluster",
    "trajectories",
]
