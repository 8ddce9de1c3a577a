"""fl_updates.artifact_id, vetted: a whole-model update is an uploaded artefact, referenced (its data column stays
empty), and read through before it counts (vetted)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03 18:20:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('fl_updates', schema=None) as batch_op:
        batch_op.add_column(sa.Column('artifact_id', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('vetted', sa.Boolean(), nullable=False, server_default=sa.true()))


def downgrade() -> None:
    op.execute("DELETE FROM fl_updates WHERE artifact_id IS NOT NULL")
    with op.batch_alter_table('fl_updates', schema=None) as batch_op:
        batch_op.drop_column('vetted')
        batch_op.drop_column('artifact_id')
