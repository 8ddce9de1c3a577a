"""deployment and update

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 02:40:37.922994
"""

from alembic import op
import sqlalchemy as sa
import sqlmodel


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('artifact_deltas',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('base_sha256', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('target_sha256', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('sha256', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('size', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('base_sha256', 'target_sha256', name='uq_artifact_deltas_pair')
    )
    op.create_table('artifacts',
    sa.Column('id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('kind', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('name', sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
    sa.Column('version', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('format', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('sha256', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('size', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('signature', sqlmodel.sql.sqltypes.AutoString(length=256), nullable=False),
    sa.Column('key_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('kind', 'name', 'version', name='uq_artifacts_kind_name_version')
    )
    with op.batch_alter_table('artifacts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_artifacts_sha256'), ['sha256'], unique=False)

    op.create_table('deployments',
    sa.Column('id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('name', sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
    sa.Column('artifact_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('kind', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('target', sa.JSON(), nullable=False),
    sa.Column('strategy', sa.JSON(), nullable=False),
    sa.Column('max_failure_percent', sa.Float(), nullable=False),
    sa.Column('failure_policy', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('timeout_s', sa.Integer(), nullable=False),
    sa.Column('allow_downgrade', sa.Boolean(), nullable=False),
    sa.Column('state', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('superseded_by', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
    sa.Column('batches', sa.Integer(), nullable=False),
    sa.Column('current_batch', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('deployments', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_deployments_artifact_id'), ['artifact_id'], unique=False)
        batch_op.create_index('ix_deployments_state', ['state'], unique=False)

    op.create_table('execution_transitions',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('execution_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('from_state', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True),
    sa.Column('to_state', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('execution_transitions', schema=None) as batch_op:
        batch_op.create_index('ix_execution_transitions_execution', ['execution_id', 'id'], unique=False)

    op.create_table('executions',
    sa.Column('id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('deployment_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('target_kind', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('target_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('batch', sa.Integer(), nullable=False),
    sa.Column('state', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('released_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('deadline_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('rollback_requested', sa.Boolean(), nullable=False),
    sa.Column('previous', sa.JSON(), nullable=True),
    sa.Column('delta', sa.Boolean(), nullable=False),
    sa.Column('detail', sa.Text(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('executions', schema=None) as batch_op:
        batch_op.create_index('ix_executions_deployment', ['deployment_id', 'batch'], unique=False)
        batch_op.create_index('ix_executions_state', ['state'], unique=False)
        batch_op.create_index('ix_executions_target', ['target_id', 'state'], unique=False)

    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.add_column(sa.Column('orders', sa.JSON(), server_default='[]', nullable=False))
        batch_op.add_column(sa.Column('orders_version', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('orders_published', sa.Integer(), server_default='0', nullable=False))
    # the default only fills the rows that exist; the application always writes the column
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.alter_column('orders', existing_type=sa.JSON(), server_default=None, existing_nullable=False)

    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('orders', sa.JSON(), server_default='[]', nullable=False))
        batch_op.add_column(sa.Column('orders_version', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('orders_published', sa.Integer(), server_default='0', nullable=False))
    # the default only fills the rows that exist; the application always writes the column
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.alter_column('orders', existing_type=sa.JSON(), server_default=None, existing_nullable=False)



def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('orders_published')
        batch_op.drop_column('orders_version')
        batch_op.drop_column('orders')

    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.drop_column('orders_published')
        batch_op.drop_column('orders_version')
        batch_op.drop_column('orders')

    with op.batch_alter_table('executions', schema=None) as batch_op:
        batch_op.drop_index('ix_executions_target')
        batch_op.drop_index('ix_executions_state')
        batch_op.drop_index('ix_executions_deployment')

    op.drop_table('executions')
    with op.batch_alter_table('execution_transitions', schema=None) as batch_op:
        batch_op.drop_index('ix_execution_transitions_execution')

    op.drop_table('execution_transitions')
    with op.batch_alter_table('deployments', schema=None) as batch_op:
        batch_op.drop_index('ix_deployments_state')
        batch_op.drop_index(batch_op.f('ix_deployments_artifact_id'))

    op.drop_table('deployments')
    with op.batch_alter_table('artifacts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_artifacts_sha256'))

    op.drop_table('artifacts')
    op.drop_table('artifact_deltas')
