"""Translations between other APIs' wire formats and the gateway's chat and completion turns."""
