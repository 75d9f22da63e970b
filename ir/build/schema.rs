//! The graph schema as Rust tables, written from `graph.proto`'s descriptor: the field numbers
//! every hand decoder matches on (`wire::fields`) and the message tables the streaming
//! transcoder walks (`io/transcode.rs`). A field added to `graph.proto` reaches every decoder
//! from here; a field of a shape the transcoder has no `Kind` for stops the build and says so.

use std::fmt::Write;

use prost_types::{
    field_descriptor_proto::{Label, Type},
    DescriptorProto, FieldDescriptorProto, FileDescriptorProto,
};

/// `pub mod MESSAGE { pub const FIELD: u32 = N; ... }` for every message of `file`, plus
/// `LAST`, its highest field number (fields above it are unknown to this schema).
pub fn field_numbers(file: &FileDescriptorProto) -> String {
    let mut out = String::new();
    for message in &file.message_type {
        let name = message.name();
        writeln!(out, "/// Field numbers of `{name}`.").unwrap();
        writeln!(out, "pub mod {} {{", snake(name)).unwrap();
        for field in &message.field {
            writeln!(
                out,
                "    pub const {}: u32 = {};",
                field.name().to_uppercase(),
                field.number()
            )
            .unwrap();
        }
        let last = message.field.iter().map(|f| f.number()).max().unwrap_or(0);
        writeln!(out, "    /// The highest field number `{name}` declares.").unwrap();
        writeln!(out, "    pub const LAST: u32 = {last};").unwrap();
        writeln!(out, "}}").unwrap();
    }
    out
}

/// The transcoder's tables: one `Message` constant per message (its full name, the JSON keys
/// pbjson accepts in its order, its fields with their `Kind`), and `EnumType`, one variant per
/// enum with the prost type that names its codes.
pub fn transcode_tables(file: &FileDescriptorProto) -> Result<String, String> {
    let package = file.package();
    let mut out = String::new();
    for message in &file.message_type {
        write_message(&mut out, package, message)?;
    }
    write_enum_type(&mut out, file);
    Ok(out)
}

fn write_message(out: &mut String, package: &str, message: &DescriptorProto) -> Result<(), String> {
    let name = message.name();
    if !message.nested_type.is_empty() || !message.enum_type.is_empty() {
        return Err(format!(
            "{name}: nested types are not supported by the transcoder"
        ));
    }
    let keys: Vec<String> = message
        .field
        .iter()
        .flat_map(|f| {
            let json = json_name(f);
            let name = f.name().to_owned();
            if json == name {
                vec![name]
            } else {
                vec![name, json]
            }
        })
        .map(|k| format!("{k:?}"))
        .collect();
    writeln!(
        out,
        "pub(crate) const {}: Message = Message {{",
        screaming(name)
    )
    .unwrap();
    writeln!(out, "    name: \"{package}.{name}\",").unwrap();
    writeln!(out, "    keys: &[{}],", keys.join(", ")).unwrap();
    writeln!(out, "    fields: &[").unwrap();
    for field in &message.field {
        writeln!(
            out,
            "        field({:?}, {:?}, {}, {}),",
            field.name(),
            json_name(field),
            field.number(),
            kind(name, field)?
        )
        .unwrap();
    }
    writeln!(out, "    ],\n}};").unwrap();
    Ok(())
}

/// The `Kind` expression of one field, from its type, label, and `oneof` membership.
fn kind(message: &str, field: &FieldDescriptorProto) -> Result<String, String> {
    let repeated = field.label() == Label::Repeated;
    let optional = field.proto3_optional();
    let oneof = field.oneof_index.is_some() && !optional;
    let type_name = || short_name(field.type_name());
    let kind = match (field.r#type(), repeated, optional, oneof) {
        (Type::String, false, false, false) => "Kind::Str".to_owned(),
        (Type::String, true, _, _) => "Kind::Strings".to_owned(),
        (Type::String, false, false, true) => "Kind::OneofStr".to_owned(),
        (Type::Bool, false, false, false) => "Kind::Bool".to_owned(),
        (Type::Bool, false, false, true) => "Kind::OneofBool".to_owned(),
        (Type::Uint32, false, false, false) => "Kind::U32".to_owned(),
        (Type::Uint32, false, true, _) => "Kind::OptionalU32".to_owned(),
        (Type::Uint32, true, _, _) => "Kind::PackedU32".to_owned(),
        (Type::Int64, true, _, _) => "Kind::PackedI64".to_owned(),
        (Type::Int64, false, false, true) => "Kind::OneofI64".to_owned(),
        (Type::Double, true, _, _) => "Kind::PackedF64".to_owned(),
        (Type::Double, false, false, true) => "Kind::OneofF64".to_owned(),
        (Type::Enum, false, false, false) => format!("Kind::Enum(EnumType::{})", type_name()),
        (Type::Message, false, false, false) => {
            format!("Kind::Message(&{})", screaming(type_name()))
        }
        (Type::Message, true, _, _) => format!("Kind::Messages(&{})", screaming(type_name())),
        (Type::Message, false, false, true) => {
            format!("Kind::OneofMessage(&{})", screaming(type_name()))
        }
        (ty, ..) => {
            return Err(format!(
                "{message}.{}: a {}{ty:?} field has no `Kind` in ir/src/io/transcode.rs; add one \
                 (how pbjson reads and writes it, how prost merges it) and map it here",
                field.name(),
                match (repeated, optional, oneof) {
                    (true, ..) => "repeated ",
                    (_, true, _) => "optional ",
                    (.., true) => "oneof ",
                    _ => "",
                },
            ))
        }
    };
    Ok(kind)
}

fn write_enum_type(out: &mut String, file: &FileDescriptorProto) {
    let names: Vec<&str> = file.enum_type.iter().map(|e| e.name()).collect();
    writeln!(
        out,
        "/// The enums of the schema, each read and named by its prost type."
    )
    .unwrap();
    writeln!(out, "#[derive(Clone, Copy)]\npub(crate) enum EnumType {{").unwrap();
    for name in &names {
        writeln!(out, "    {name},").unwrap();
    }
    writeln!(out, "}}\n\nimpl EnumNames for EnumType {{").unwrap();
    writeln!(
        out,
        "    /// The proto3 JSON name of `code`, if the enum has one."
    )
    .unwrap();
    writeln!(
        out,
        "    fn name(self, code: i32) -> Option<&'static str> {{\n        match self {{"
    )
    .unwrap();
    for name in &names {
        writeln!(
            out,
            "            EnumType::{name} => pb::{name}::try_from(code).ok().map(|e| e.as_str_name()),"
        )
        .unwrap();
    }
    writeln!(out, "        }}\n    }}\n").unwrap();
    writeln!(out, "    /// The code of the proto3 JSON name `name`.").unwrap();
    writeln!(
        out,
        "    fn number(self, name: &str) -> Option<i32> {{\n        match self {{"
    )
    .unwrap();
    for name in &names {
        writeln!(
            out,
            "            EnumType::{name} => pb::{name}::from_str_name(name).map(|e| e as i32),"
        )
        .unwrap();
    }
    writeln!(out, "        }}\n    }}\n}}").unwrap();
}

/// The proto3 JSON name: the descriptor's, else lowerCamelCase of the field name, as protoc
/// derives it.
fn json_name(field: &FieldDescriptorProto) -> String {
    if let Some(json) = &field.json_name {
        return json.clone();
    }
    let mut out = String::new();
    let mut upper = false;
    for c in field.name().chars() {
        match (c, upper) {
            ('_', _) => upper = true,
            (c, true) => {
                out.push(c.to_ascii_uppercase());
                upper = false;
            }
            (c, false) => out.push(c),
        }
    }
    out
}

/// `.recompute.ir.v1.SchemaFacts` -> `SchemaFacts`.
fn short_name(type_name: &str) -> &str {
    type_name.rsplit('.').next().unwrap_or(type_name)
}

/// `SchemaFacts` -> `schema_facts`.
fn snake(camel: &str) -> String {
    let mut out = String::new();
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// `SchemaFacts` -> `SCHEMA_FACTS`.
fn screaming(camel: &str) -> String {
    snake(camel).to_uppercase()
}
