"""evaluations.decode_tokens_per_second, evaluations.kv_cache_bytes: what the decode
protocol measures besides its scores

The ``decode`` protocol (issue 21) reads a prompt in one pass and decodes the rest one
token at a time with a KV cache; each of its points records the tokens decoded per
second and the most bytes of keys and values one sequence's cache held. Both are NULL
for the other protocols and for every point evaluated before; the downgrade drops them.

Revision ID: 0012
Revises: 0011
Create Date: 2027-02-01 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("evaluations", sa.Column("decode_tokens_per_second", sa.Double(), nullable=True))
    op.add_column("evaluations", sa.Column("kv_cache_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    for column in ("kv_cache_bytes", "decode_tokens_per_second"):
        op.drop_column("evaluations", column)
