"""fl_rounds keep the closing attempt's participants (a stale update counts only from one of them)

Revision ID: 0008_fl_round_participants
Revises: 0008
Create Date: 2026-12-02 08:10:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision = '0008_fl_round_participants'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # rounds closed before this revision keep NULL: no late update for them counts as stale
    with op.batch_alter_table('fl_rounds', schema=None) as batch_op:
        batch_op.add_column(sa.Column('participant_ids', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('fl_rounds', schema=None) as batch_op:
        batch_op.drop_column('participant_ids')
