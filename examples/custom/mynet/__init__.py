"""An example of your own model and dataset for ps-compose (README: "Your own model and dataset")."""
