"""The Rust frontend's schema, read from its source with tree-sitter.

The fixture is vLLM 0.34.0's own ``protocol/handshake.rs`` (Apache-2.0, unchanged), from the release's sdist.
"""

from pathlib import Path

from replay_proxy.wire.rust import read_protocol
from replay_proxy.wire.registry import load_rust_schema, shipped_releases

HANDSHAKE = Path(__file__).parent / "fixtures" / "rust-0.34.0"

SERDE = """
use serde::{Deserialize, Serialize};
use serde_tuple::{Deserialize_tuple, Serialize_tuple};

#[derive(Debug, Serialize_tuple, Deserialize_tuple)]
pub struct Output {
    pub request_id: String,
    #[serde(default)]
    pub r#type: Option<u32>,
    #[serde_as(deserialize_as = "Vec<AllowTrailingFields>")]
    #[serde(default)]
    pub items: Vec<Item>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct WireParams {
    #[serde(rename = "_eos_token_id")]
    eos_token_id: Option<u32>,
    #[serde(flatten)]
    kind: Kind,
    #[serde(skip)]
    cache: u8,
}

pub struct Params { pub eos: Option<u32> }

impl Serialize for Params {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        WireParams::from(self.clone()).serialize(s)
    }
}

#[derive(Serialize_repr, Deserialize_repr)]
#[repr(u8)]
pub enum Finish { Stop = 0, Length, Abort = 5 }

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind { JsonObject, #[serde(rename = "re")] Regex }

#[cfg(test)]
mod tests {
    #[derive(Serialize, Deserialize)]
    struct Fixture { x: u8 }
}
"""


def test_each_serde_declaration_is_read_as_the_wire_has_it(tmp_path):
    (tmp_path / "mod.rs").write_text(SERDE)
    schema = read_protocol(tmp_path, "test")
    output = schema.structs["Output"]
    assert output.encoding == "array" and [f.name for f in output.fields] == ["request_id", "type", "items"]
    assert [(f.optional, f.default) for f in output.fields] == [(False, False), (True, True), (False, True)]
    assert output.fields[2].allow_trailing and not output.fields[1].allow_trailing
    params = schema.structs["WireParams"]
    assert params.encoding == "map" and params.deny_unknown_fields
    assert [(f.name, f.rust_name, f.default, f.flatten, f.skip) for f in params.fields] == [
        ("_eos_token_id", "eos_token_id", True, False, False), ("kind", "kind", True, True, False),
        ("cache", "cache", True, False, True)]
    assert schema.wire_form("Params") == "WireParams"  # its hand-written Serialize goes through WireParams
    assert schema.enums["Finish"].repr and schema.enums["Finish"].variants == ["0", "1", "5"]
    assert schema.enums["Kind"].variants == ["json_object", "re"]
    assert "Fixture" not in schema.structs  # a #[cfg(test)] module is not the protocol


def test_a_release_s_own_source_gives_its_shipped_schema():
    read = read_protocol(HANDSHAKE, "0.34.0").structs["EngineCoreReadyResponse"]
    shipped = load_rust_schema("0.34.0").structs["EngineCoreReadyResponse"]
    assert read == shipped
    assert [f.name for f in read.fields][:3] == ["max_model_len", "num_gpu_blocks", "block_size"]
    assert next(f for f in read.fields if f.rust_name == "effective_data_parallel_size").name == "data_parallel_size"


def test_every_shipped_release_has_its_rust_schema():
    assert all(load_rust_schema(release) is not None for release in shipped_releases())
