"""Set-up script, pinned requirements and launcher configs."""
