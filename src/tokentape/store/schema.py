"""The store's two tables, each column named once: its SQL type, and the attribute of the object it
stores with how that is written and read back. The DDL, the statements, the migration of a store
written by an earlier version, a turn's row and the turn rebuilt from it all come from these tuples.

Adding a column is one line in `SESSION_COLUMNS` or `TURN_COLUMNS`, e.g.
`Column("weight_version", "INTEGER", "weight_version")` for a `TurnNode.weight_version` stored as it
is. Stores written before it gain it on open (`ALTER TABLE ... ADD COLUMN`), so its SQL type must
allow that: nullable, or NOT NULL with a DEFAULT; rows written before read back as NULL (or the
default), which `decode` may turn into the attribute's own default. A column the store fills itself
(no attribute) takes its value from the `given` mapping of `row`.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokentape.core.images import DecodedImage, ImageFacts, ImageRun, runs_from_json, runs_to_json
from tokentape.core.outcome import Outcome
from tokentape.core.session import SessionTree
from tokentape.core.tape import Origin, Rewrite, TurnNode
from tokentape.core.versions import spans_from_json, spans_to_json

__all__ = [
    "IMAGES",
    "SELECT_IMAGE_FACTS",
    "SESSIONS",
    "SESSION_COLUMNS",
    "TURNS",
    "TURN_COLUMNS",
    "Column",
    "Table",
    "decoded_image",
    "image_facts",
    "image_row",
    "session_row",
    "session_tree",
    "turn_node",
    "turn_row",
]


@dataclass(frozen=True, slots=True)
class Column:
    """`name` and `sql` (type and constraints) in the table; `field`: the attribute it stores (None:
    the store gives the value); `encode` / `decode`: attribute value to column value and back (None:
    stored as it is)."""

    name: str
    sql: str
    field: str | None = None
    encode: Callable[[Any], Any] | None = None
    decode: Callable[[Any], Any] | None = None


@dataclass(frozen=True, slots=True)
class Table:
    """`key`: the primary key's columns; `fixed`: columns an upsert of an existing row leaves as they are."""

    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...]
    fixed: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(column.name for column in self.columns)

    def ddl(self) -> str:
        lines = [f"    {column.name} {column.sql}" for column in self.columns]
        if len(self.key) > 1:
            lines.append(f"    PRIMARY KEY ({', '.join(self.key)})")
        return f"CREATE TABLE IF NOT EXISTS {self.name} (\n" + ",\n".join(lines) + "\n);\n"

    def upsert(self, where: str = "") -> str:
        """Insert a row, or update every column but the key and the fixed ones of the row already there
        (`where`: only if that row matches)."""
        kept = set(self.key) | set(self.fixed)
        updated = ", ".join(f"{name} = excluded.{name}" for name in self.names if name not in kept)
        return (
            f"INSERT INTO {self.name} {self._values()} "
            f"ON CONFLICT({', '.join(self.key)}) DO UPDATE SET {updated}" + (f" WHERE {where}" if where else "")
        )

    def _values(self) -> str:
        return f"({', '.join(self.names)}) VALUES ({', '.join('?' * len(self.columns))})"

    def insert_or_replace(self) -> str:
        return f"INSERT OR REPLACE INTO {self.name} {self._values()}"

    def insert_or_ignore(self) -> str:
        return f"INSERT OR IGNORE INTO {self.name} {self._values()}"

    def select(self, where: str, order: str = "") -> str:
        return f"SELECT {', '.join(self.names)} FROM {self.name} WHERE {where}" + (
            f" ORDER BY {order}" if order else ""
        )

    def added_since(self, present: set[str]) -> list[str]:
        """The statements that give a table written by an earlier version the columns it lacks."""
        return [f"ALTER TABLE {self.name} ADD COLUMN {c.name} {c.sql}" for c in self.columns if c.name not in present]

    def row(self, item: object, given: Mapping[str, Any]) -> tuple[Any, ...]:
        """`item`'s row, in column order; a column without an attribute takes its value from `given`."""
        values = []
        for column in self.columns:
            if column.field is None:
                values.append(given[column.name])
                continue
            value = getattr(item, column.field)
            values.append(value if column.encode is None else column.encode(value))
        return tuple(values)

    def fields(self, row: Sequence[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """A row read back: (attribute values by attribute name, the store's own values by column name)."""
        fields: dict[str, Any] = {}
        own: dict[str, Any] = {}
        for column, value in zip(self.columns, row, strict=True):
            if column.field is None:
                own[column.name] = value
            else:
                fields[column.field] = value if column.decode is None else column.decode(value)
        return fields, own


def _ints(values: Sequence[int]) -> bytes:
    return array("q", values).tobytes()


def _floats(values: Sequence[float]) -> bytes:
    return array("d", values).tobytes()


def _unints(blob: bytes) -> tuple[int, ...]:
    out = array("q")
    out.frombytes(blob)
    return tuple(out)


def _unfloats(blob: bytes) -> tuple[float, ...]:
    out = array("d")
    out.frombytes(blob)
    return tuple(out)


def _outcome_json(outcome: Outcome) -> str:
    return json.dumps(
        {
            "group_id": outcome.group_id,
            "metadata": outcome.metadata,
            "reward": outcome.reward,
            "branch_rewards": outcome.branch_rewards,
            "turn_rewards": outcome.turn_rewards,
            "finished_at": outcome.finished_at,
        }
    )


def _restore_outcome(tree: SessionTree, outcome_json: str) -> None:
    saved = json.loads(outcome_json)
    outcome = tree.outcome
    outcome.group_id = saved.get("group_id")
    outcome.metadata = saved.get("metadata") or {}
    outcome.reward = saved.get("reward")
    outcome.branch_rewards = {int(k): v for k, v in (saved.get("branch_rewards") or {}).items()}
    outcome.turn_rewards = {int(k): v for k, v in (saved.get("turn_rewards") or {}).items()}
    outcome.finished_at = saved.get("finished_at")


SESSION_COLUMNS = (
    Column("id", "TEXT PRIMARY KEY", "session_id"),
    Column("policy", "TEXT NOT NULL", "policy"),
    Column("created_at", "REAL NOT NULL"),  # the outcome's, kept in a column to list sessions in order
    Column("outcome", "TEXT NOT NULL"),  # JSON: group, metadata, rewards, finish time
    Column("deleted", "INTEGER NOT NULL DEFAULT 0"),  # a tombstone: no late write brings the session back
    # the SHA-256 of the session's key (never the key): set once with it, which no row update touches
    Column("key_hash", "BLOB"),
)
SESSIONS = Table("sessions", SESSION_COLUMNS, ("id",), fixed=("created_at", "deleted", "key_hash"))


def session_row(tree: SessionTree) -> tuple[Any, ...]:
    given = {
        "created_at": tree.outcome.created_at,
        "outcome": _outcome_json(tree.outcome),
        "deleted": 0,
        "key_hash": None,
    }
    return SESSIONS.row(tree, given)


def session_tree(row: Sequence[Any]) -> SessionTree:
    """A session rebuilt from its row, without its turns."""
    fields, own = SESSIONS.fields(row)
    tree = SessionTree(fields.pop("session_id"), fields.pop("policy"), created_at=own["created_at"])
    _restore_outcome(tree, own["outcome"])
    for name, value in fields.items():  # what columns added since hold
        setattr(tree, name, value)
    return tree


def _runs_json(runs: Sequence[ImageRun]) -> str | None:
    return json.dumps(runs_to_json(runs)) if runs else None


def _runs(saved: str | None) -> tuple[ImageRun, ...]:
    return runs_from_json(json.loads(saved)) if saved else ()


def _json_or_none(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def _from_json_or_none(saved: str | None) -> Any:
    return None if saved is None else json.loads(saved)


def _rewrite_json(rewrite: Rewrite | None) -> str | None:
    return json.dumps(rewrite.as_dict()) if rewrite else None


def _rewrite(saved: str | None) -> Rewrite | None:
    return Rewrite(**json.loads(saved)) if saved else None


# In the order of the table's columns, which is also the order of a store written by an earlier version
# (columns added later come last).
TURN_COLUMNS = (
    Column("session_id", "TEXT NOT NULL"),
    Column("id", "INTEGER NOT NULL", "id"),
    Column("parent", "INTEGER"),  # the parent turn's id: the node is linked to it on reading
    Column("keep", "INTEGER NOT NULL", "keep"),
    Column("context", "BLOB NOT NULL", "context", _ints, _unints),
    Column("context_origin", "INTEGER NOT NULL", "context_origin", int, Origin),
    Column("sampled", "BLOB NOT NULL", "sampled", _ints, _unints),
    Column("logprobs", "BLOB NOT NULL", "logprobs", _floats, _unfloats),
    Column("finish_reason", "TEXT NOT NULL", "finish_reason"),
    Column("prompt_chain", "BLOB NOT NULL", "prompt_chain"),
    Column("chain", "BLOB NOT NULL", "chain"),
    Column("message_count", "INTEGER NOT NULL", "message_count"),
    Column("reply", "TEXT NOT NULL", "reply", lambda reply: json.dumps(dict(reply)), json.loads),
    Column("rewrite", "TEXT", "rewrite", _rewrite_json, _rewrite),
    Column("request_key", "BLOB"),  # the retry key of the request that made the turn, given with it
    Column("policy_version", "TEXT", "policy_version"),
    Column("request_no", "INTEGER", "request"),
    Column("trace_id", "TEXT", "trace_id"),
    Column("logprob_mode", "TEXT", "logprob_mode"),
    Column("template_inputs", "TEXT"),  # NULL: the parent's (long episodes store them once)
    Column("constrained", "INTEGER NOT NULL DEFAULT 0", "constrained", int, bool),
    # JSON: the weights versions over the sampled tokens (core.versions); NULL: none recorded
    Column("policy_spans", "TEXT", "policy_spans", spans_to_json, spans_from_json),
    # JSON: the image runs its context brought ([digest, start, length, t, h, w]); the bytes are in `images`
    Column("images", "TEXT", "images", _runs_json, _runs),
    Column("shape_chain", "BLOB", "shape_chain"),  # the history's chain with images anonymous
    # JSON: temperature, top_p, top_k, min_p the turn was sampled with; NULL: recorded before they were
    Column("sampling", "TEXT", "sampling", _json_or_none, _from_json_or_none),
)
TURNS = Table("turns", TURN_COLUMNS, ("session_id", "id"))

# Images by content: one row per distinct image in the whole store, whatever the number of turns,
# branches or sessions that show it.
IMAGE_COLUMNS = (
    Column("digest", "TEXT PRIMARY KEY", "digest"),
    Column("media_type", "TEXT NOT NULL", "media_type"),
    Column("width", "INTEGER NOT NULL", "width"),
    Column("height", "INTEGER NOT NULL", "height"),
    Column("data", "BLOB NOT NULL", "data"),
)
IMAGES = Table("images", IMAGE_COLUMNS, ("digest",))


def image_row(image: DecodedImage) -> tuple[Any, ...]:
    return IMAGES.row(image, {})


def decoded_image(row: Sequence[Any]) -> DecodedImage:
    fields, _ = IMAGES.fields(row)
    return DecodedImage(**fields)


# an image's facts without its bytes: what a session's tree keeps (`SessionTree.images`)
SELECT_IMAGE_FACTS = "SELECT digest, media_type, width, height, length(data) FROM images WHERE digest IN ({})"


def image_facts(row: Sequence[Any]) -> ImageFacts:
    digest, media_type, width, height, size = row
    return ImageFacts(str(digest), str(media_type), int(width), int(height), int(size))


def _inputs_json(node: TurnNode) -> str | None:
    """A turn's template inputs; NULL when it shares its parent's (long episodes store them once)."""
    if node.parent is not None and node.template_inputs is node.parent.template_inputs:
        return None
    return json.dumps(node.template_inputs) if node.template_inputs is not None or node.parent else None


def turn_row(session_id: str, node: TurnNode, request_key: bytes | None) -> tuple[Any, ...]:
    given = {
        "session_id": session_id,
        "parent": node.parent.id if node.parent is not None else None,
        "request_key": request_key,
        "template_inputs": _inputs_json(node),
    }
    return TURNS.row(node, given)


def turn_node(tree: SessionTree, row: Sequence[Any]) -> TurnNode:
    """The turn a row of `tree`'s session stands for, linked to its parent (read before it)."""
    fields, own = TURNS.fields(row)
    parent = own["parent"]
    if parent is not None and not 0 <= parent < len(tree.nodes):
        raise ValueError(f"turn {fields['id']} points at parent turn {parent}, which is not stored")
    parent_node = tree.nodes[parent] if parent is not None else None
    saved_inputs = own["template_inputs"]
    if saved_inputs is not None:
        inputs = json.loads(saved_inputs)
    else:
        inputs = parent_node.template_inputs if parent_node is not None else None
    return TurnNode(
        **fields,
        parent=parent_node,
        depth=0 if parent_node is None else parent_node.depth + 1,
        request_key=own["request_key"],
        template_inputs=inputs,
    )
