"""cpu_model: the CPU a benchmark ran on, with the core generation where the model name hides it."""
import pytest

from cpumoe.bench.machine import amd_core, cpu_model


def cpuinfo(vendor: str, family: int, model: int, name: str) -> str:
    block = f"processor\t: {{}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\nmodel name\t: {name}\n"
    return "\n".join(block.format(i) for i in range(2))


@pytest.mark.parametrize("family, model, name, expected", [
    (26, 2, "AMD EPYC", "AMD EPYC (family 26, model 2, Zen 5)"),
    (25, 17, "AMD EPYC 9654 96-Core Processor", "AMD EPYC 9654 96-Core Processor (family 25, model 17, Zen 4)"),
    (25, 1, "AMD EPYC 7763 64-Core Processor", "AMD EPYC 7763 64-Core Processor (family 25, model 1, Zen 3)"),
    (23, 49, "AMD EPYC 7742 64-Core Processor", "AMD EPYC 7742 64-Core Processor (family 23, model 49, Zen 2)"),
])
def test_amd_names_the_core(family, model, name, expected):
    assert cpu_model(cpuinfo("AuthenticAMD", family, model, name)) == expected


def test_intel_gets_numbers_only():
    text = cpuinfo("GenuineIntel", 6, 207, "INTEL(R) XEON(R) PLATINUM 8581C CPU @ 2.10GHz")
    assert cpu_model(text) == "INTEL(R) XEON(R) PLATINUM 8581C CPU @ 2.10GHz (family 6, model 207)"


def test_arm_keeps_its_name():
    text = "processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n\nModel\t\t: Neoverse-V1 board\n"
    assert cpu_model(text) == "Neoverse-V1 board"


def test_unknown_amd_family_has_no_core_name():
    assert amd_core(0x15, 2) is None
    assert amd_core(0x1A, 0x44) == "Zen 5"


def test_a_model_field_that_is_a_name_is_left_alone():
    text = "processor\t: 0\ncpu family\t: POWER\nmodel\t\t: IBM,9080-HEX\ncpu model\t: POWER10\n"
    assert cpu_model(text) == "POWER10"
