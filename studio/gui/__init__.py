"""The desktop app: thin PySide6 views over studio.core. Never imports torch."""
