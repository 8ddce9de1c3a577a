"""idempotency records keep a secret-bearing answer only as its hash

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 07:40:00.000000
"""

import hashlib

import sqlalchemy as sa
import sqlmodel
from alembic import op

from cloud.api.guards import carries_secret

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None

_records = sa.table(
    'idempotency_records',
    sa.column('id', sa.Integer()),
    sa.column('response_headers', sa.JSON()),
    sa.column('response_body', sa.Text()),
    sa.column('response_sha256', sa.String(64)),
)


def upgrade() -> None:
    with op.batch_alter_table('idempotency_records', schema=None) as batch_op:
        batch_op.add_column(sa.Column('response_sha256', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True))
    # answers stored in clear by earlier versions: a bootstrap or download token in them is withheld now
    bind = op.get_bind()
    rows = bind.execute(sa.select(_records.c.id, _records.c.response_headers, _records.c.response_body).where(_records.c.response_body.is_not(None))).all()
    for row_id, headers, body in rows:
        raw = body.encode()
        if carries_secret(raw, headers or []):
            bind.execute(
                _records.update().where(_records.c.id == row_id)
                .values(response_body=None, response_headers=None, response_sha256=hashlib.sha256(raw).hexdigest())
            )  # fmt: skip


def downgrade() -> None:
    # the withheld answers cannot be restored; their records go, so such a key runs its request again
    op.execute(_records.delete().where(_records.c.response_sha256.is_not(None)))
    with op.batch_alter_table('idempotency_records', schema=None) as batch_op:
        batch_op.drop_column('response_sha256')
