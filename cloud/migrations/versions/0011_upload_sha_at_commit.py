"""artifact_uploads.sha256 nullable: a session may be started without the whole SHA-256 and declare it in its commit

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 14:50:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('artifact_uploads', schema=None) as batch_op:
        batch_op.alter_column('sha256', existing_type=sa.String(length=64), nullable=True)


def downgrade() -> None:
    op.execute("DELETE FROM artifact_uploads WHERE sha256 IS NULL")
    with op.batch_alter_table('artifact_uploads', schema=None) as batch_op:
        batch_op.alter_column('sha256', existing_type=sa.String(length=64), nullable=False)
