"""trained_models, training_manifests: what each training task's worker published and reported, its algorithm as admitted

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03 11:00:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'trained_models',
        sa.Column('num_examples', sa.BigInteger(), nullable=False),
        sa.Column('metrics', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('worker_id', sa.String(length=64), nullable=False),
        sa.Column('task_id', sa.String(length=64), nullable=False),
        sa.Column('node_id', sa.String(length=64), nullable=False),
        sa.Column('parameters_id', sa.String(length=64), nullable=False),
        sa.Column('onnx_id', sa.String(length=64), nullable=True),
        sa.Column('steps', sa.Integer(), nullable=False),
        sa.Column('resumed_from', sa.Integer(), nullable=False),
        sa.Column('loss', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('worker_id'),
    )
    with op.batch_alter_table('trained_models', schema=None) as batch_op:
        batch_op.create_index('ix_trained_models_task', ['task_id'], unique=False)
    op.create_table(
        'training_manifests',
        sa.Column('manifest', sa.JSON(), nullable=False),
        sa.Column('task_id', sa.String(length=64), nullable=False),
        sa.Column('algorithm_id', sa.String(length=64), nullable=False),
        sa.Column('output_name', sa.String(length=128), nullable=False),
        sa.Column('output_version', sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint('task_id'),
        sa.UniqueConstraint('output_name', 'output_version', name='uq_training_manifests_output'),
    )


def downgrade() -> None:
    op.drop_table('training_manifests')
    with op.batch_alter_table('trained_models', schema=None) as batch_op:
        batch_op.drop_index('ix_trained_models_task')
    op.drop_table('trained_models')
