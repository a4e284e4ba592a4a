"""What was asked: each pretrain flag declared once, the rules between flags, the typed config."""
