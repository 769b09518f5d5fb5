"""vLLM's entry point for NECTAR (``vllm.general_plugins: nectar``). Acts only for a server started with
document states (NECTAR_VLLM_STATES=1, set by ``nectar serve --engine vllm``); the plugin itself is
``nectar.vllm.plugin``, imported from the nectar checkout on that server's PYTHONPATH. Any other vLLM
server in the same environment never imports nectar."""
import os


def register() -> None:
    if os.environ.get("NECTAR_VLLM_STATES") != "1":
        return
    from nectar.vllm.plugin import register as nectar_register

    nectar_register()
