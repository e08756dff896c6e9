"""The Slurm backend (``slurm``): one ``sbatch`` per job on a cluster the site already runs."""
