"""The pack stages in order: convert (many workers), plan (one), materialize (many; the last one
finalizes). One module per stage, beside the work-folder rules they share (`workdir`)."""
