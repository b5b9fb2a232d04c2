"""The closed loop: findings → on-demand profiles of the suspect and a peer → call paths."""
