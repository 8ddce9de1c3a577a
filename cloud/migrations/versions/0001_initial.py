"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-30 00:47:24.381642
"""

from alembic import op
import sqlalchemy as sa
import sqlmodel


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('api_tokens',
    sa.Column('id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('token_hash', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('role', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('name', sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('token_hash')
    )
    op.create_table('bootstrap_tokens',
    sa.Column('token_hash', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('owner_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('used_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('token_hash')
    )
    with op.batch_alter_table('bootstrap_tokens', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_bootstrap_tokens_owner_id'), ['owner_id'], unique=False)

    op.create_table('certificates',
    sa.Column('serial', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('identity', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('issued_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('not_after', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('serial')
    )
    with op.batch_alter_table('certificates', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_certificates_identity'), ['identity'], unique=False)

    op.create_table('device_events',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('message_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('node_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('device_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=True),
    sa.Column('type', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('severity', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('message', sa.Text(), nullable=True),
    sa.Column('data', sa.JSON(), nullable=False),
    sa.Column('ts', sa.DateTime(timezone=True), nullable=False),
    sa.Column('received_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('message_id')
    )
    with op.batch_alter_table('device_events', schema=None) as batch_op:
        batch_op.create_index('ix_device_events_device', ['device_id', 'id'], unique=False)

    op.create_table('devices',
    sa.Column('id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('node_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('name', sqlmodel.sql.sqltypes.AutoString(length=128), nullable=True),
    sa.Column('model', sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
    sa.Column('description', sa.Text(), nullable=False),
    sa.Column('labels', sa.JSON(), nullable=False),
    sa.Column('state', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('desired', sa.JSON(), nullable=False),
    sa.Column('desired_version', sa.Integer(), nullable=False),
    sa.Column('desired_published', sa.Integer(), nullable=False),
    sa.Column('reported', sa.JSON(), nullable=False),
    sa.Column('reported_version', sa.Integer(), nullable=False),
    sa.Column('reported_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('certificate_serial', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
    sa.Column('certificate_not_after', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_state_change_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('health', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True),
    sa.Column('agent_version', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
    sa.Column('uptime_s', sa.Float(), nullable=True),
    sa.Column('resources', sa.JSON(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_devices_node_id'), ['node_id'], unique=False)

    op.create_table('idempotency_records',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('principal', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('key', sqlmodel.sql.sqltypes.AutoString(length=255), nullable=False),
    sa.Column('request_hash', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('status_code', sa.Integer(), nullable=True),
    sa.Column('response_headers', sa.JSON(), nullable=True),
    sa.Column('response_body', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('principal', 'key', name='uq_idempotency_principal_key')
    )
    op.create_table('labels',
    sa.Column('owner_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('key', sqlmodel.sql.sqltypes.AutoString(length=317), nullable=False),
    sa.Column('value', sqlmodel.sql.sqltypes.AutoString(length=63), nullable=False),
    sa.PrimaryKeyConstraint('owner_id', 'key')
    )
    with op.batch_alter_table('labels', schema=None) as batch_op:
        batch_op.create_index('ix_labels_key_value', ['key', 'value'], unique=False)

    op.create_table('leases',
    sa.Column('name', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('holder', sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_table('node_transitions',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('node_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('from_state', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True),
    sa.Column('to_state', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('reason', sqlmodel.sql.sqltypes.AutoString(length=256), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('node_transitions', schema=None) as batch_op:
        batch_op.create_index('ix_node_transitions_node', ['node_id', 'id'], unique=False)

    op.create_table('nodes',
    sa.Column('id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('name', sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
    sa.Column('kind', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('description', sa.Text(), nullable=False),
    sa.Column('labels', sa.JSON(), nullable=False),
    sa.Column('state', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('admin_state', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('certificate_serial', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
    sa.Column('certificate_not_after', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_state_change_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('health', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True),
    sa.Column('health_detail', sa.Text(), nullable=True),
    sa.Column('agent_version', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
    sa.Column('uptime_s', sa.Float(), nullable=True),
    sa.Column('resources', sa.JSON(), nullable=True),
    sa.Column('desired', sa.JSON(), nullable=False),
    sa.Column('desired_version', sa.Integer(), nullable=False),
    sa.Column('desired_published', sa.Integer(), nullable=False),
    sa.Column('reported', sa.JSON(), nullable=False),
    sa.Column('reported_version', sa.Integer(), nullable=False),
    sa.Column('reported_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.create_index('ix_nodes_state', ['state'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_index('ix_nodes_state')

    op.drop_table('nodes')
    with op.batch_alter_table('node_transitions', schema=None) as batch_op:
        batch_op.drop_index('ix_node_transitions_node')

    op.drop_table('node_transitions')
    op.drop_table('leases')
    with op.batch_alter_table('labels', schema=None) as batch_op:
        batch_op.drop_index('ix_labels_key_value')

    op.drop_table('labels')
    op.drop_table('idempotency_records')
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_devices_node_id'))

    op.drop_table('devices')
    with op.batch_alter_table('device_events', schema=None) as batch_op:
        batch_op.drop_index('ix_device_events_device')

    op.drop_table('device_events')
    with op.batch_alter_table('certificates', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_certificates_identity'))

    op.drop_table('certificates')
    with op.batch_alter_table('bootstrap_tokens', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_bootstrap_tokens_owner_id'))

    op.drop_table('bootstrap_tokens')
    op.drop_table('api_tokens')
