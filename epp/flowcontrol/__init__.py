"""Flow control (GIE's ``flowcontrol``): saturation detection and admission."""
