"""tokentape on Ray core: gateway actors that own their sessions, a session directory, store
shards gathered on export, and a trajectory queue for a trainer in the same cluster.
Needs the optional dependency: `pip install -e '.[ray]'` in a clone of the repository."""

from tokentape.ray.cluster import (
    Cluster,
    ClusterSettings,
    TrajectoryReader,
    connect,
    front_app,
    start_cluster,
    trajectories,
)

__all__ = [
    "Cluster",
    "ClusterSettings",
    "TrajectoryReader",
    "connect",
    "front_app",
    "start_cluster",
    "trajectories",
]
