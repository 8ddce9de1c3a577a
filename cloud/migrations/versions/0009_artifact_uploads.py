"""artifact_uploads: chunked upload sessions (their chunks are files under the data dir)

Revision ID: 0009
Revises: 0008_fl_round_participants
Create Date: 2026-12-02 16:40:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008_fl_round_participants'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'artifact_uploads',
        sa.Column('size', sa.BigInteger(), nullable=False),
        sa.Column('chunk_size', sa.BigInteger(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('id', sa.String(length=64), nullable=False),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('name', sa.String(length=128), nullable=False),
        sa.Column('version', sa.String(length=64), nullable=False),
        sa.Column('format', sa.String(length=16), nullable=False),
        sa.Column('sha256', sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    with op.batch_alter_table('artifact_uploads', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_artifact_uploads_expires_at'), ['expires_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('artifact_uploads', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_artifact_uploads_expires_at'))
    op.drop_table('artifact_uploads')
