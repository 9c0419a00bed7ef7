"""The fast paths: each one narrow function of leviathan.py that plain torch runs far slower, tested
equal to it and checked against the model file when a script installs it (fast_paths.py). Nothing
here imports anything of the project but leviathan.py."""
