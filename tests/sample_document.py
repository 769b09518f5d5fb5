"""The short test document shared by every test module (tests/ is on sys.path via conftest)."""

DOC = (
    "The lighthouse keeper of Varn Island kept a ledger of every ship that passed. "
    "In the winter of 1871 the schooner Meridian ran aground on the northern reef, and the keeper "
    "rowed out twice to bring its seven sailors ashore. The ledger records that the Meridian carried "
    "salt cod and barrels of lamp oil, and that her captain, Ilse Brandt, later bought the island. "
) * 3
