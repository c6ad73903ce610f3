"""Small pieces any area may use; nothing here imports the rest of xrec."""
