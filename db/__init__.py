"""The results database: SQLAlchemy models, sessions, migrations and read queries."""
