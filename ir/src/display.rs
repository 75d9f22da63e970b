//! Text from an input file made safe to quote in a one-line message: control characters and
//! the invisible characters that reorder or hide text on a terminal are escaped, and a long
//! text keeps its head and tail and says how many bytes were cut. Every message that quotes a
//! name, a path or another library's error about the input goes through here, so one error
//! stays one short line whatever the file holds.

use std::{borrow::Cow, fmt, path::Path};

/// The longest name shown whole, in bytes of the original text.
const NAME_LIMIT: usize = 160;
/// The longest message of another library (which may quote the input) shown whole.
const MESSAGE_LIMIT: usize = 480;

/// A name from the input (node, value, model, unit, op, attribute, marker), escaped and
/// shortened to at most [`NAME_LIMIT`] bytes before escaping.
pub fn name(text: &str) -> Shown<'_> {
    Shown {
        text: Cow::Borrowed(text),
        limit: NAME_LIMIT,
    }
}

/// A file path, escaped and shortened like a name.
pub fn path(path: &Path) -> Shown<'_> {
    Shown {
        text: path.to_string_lossy(),
        limit: NAME_LIMIT,
    }
}

/// A message from another library about the input (a JSON parser's, which quotes unknown
/// keys and bad strings), escaped and shortened to at most [`MESSAGE_LIMIT`] bytes.
pub fn message(text: &str) -> Shown<'_> {
    Shown {
        text: Cow::Borrowed(text),
        limit: MESSAGE_LIMIT,
    }
}

/// A list of numbers (a shape) showing at most its first and last few entries.
pub fn numbers<T: fmt::Display>(items: &[T]) -> Numbers<'_, T> {
    Numbers(items)
}

/// Text to show: see [`name`], [`path`] and [`message`].
pub struct Shown<'a> {
    text: Cow<'a, str>,
    limit: usize,
}

/// Bytes kept at each end of a shortened text.
fn kept_at_each_end(limit: usize) -> usize {
    limit * 2 / 5
}

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text: &str = &self.text;
        if text.len() <= self.limit {
            return write_escaped(f, text);
        }
        let keep = kept_at_each_end(self.limit);
        let head = &text[..floor_boundary(text, keep)];
        let tail = &text[ceil_boundary(text, text.len() - keep)..];
        let cut = text.len() - head.len() - tail.len();
        write_escaped(f, head)?;
        write!(f, "[... {cut} bytes cut ...]")?;
        write_escaped(f, tail)
    }
}

impl fmt::Debug for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The largest char boundary of `text` at or below `at`.
fn floor_boundary(text: &str, mut at: usize) -> usize {
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// The smallest char boundary of `text` at or above `at`.
fn ceil_boundary(text: &str, mut at: usize) -> usize {
    while !text.is_char_boundary(at) {
        at += 1;
    }
    at
}

fn write_escaped(f: &mut fmt::Formatter<'_>, text: &str) -> fmt::Result {
    let mut plain = 0;
    for (at, c) in text.char_indices() {
        let escape = match c {
            '\\' => Some(Escape::Text("\\\\")),
            '\n' => Some(Escape::Text("\\n")),
            '\r' => Some(Escape::Text("\\r")),
            '\t' => Some(Escape::Text("\\t")),
            c if must_escape(c) => Some(Escape::Code(c)),
            _ => None,
        };
        if let Some(escape) = escape {
            f.write_str(&text[plain..at])?;
            match escape {
                Escape::Text(s) => f.write_str(s)?,
                Escape::Code(c) => write!(f, "\\u{{{:x}}}", u32::from(c))?,
            }
            plain = at + c.len_utf8();
        }
    }
    f.write_str(&text[plain..])
}

enum Escape {
    Text(&'static str),
    Code(char),
}

/// Control characters (they break lines, move the cursor, start terminal escape sequences),
/// line and paragraph separators, and the invisible format characters that reorder or hide
/// text (bidirectional overrides and isolates, zero-width characters, the byte-order mark).
fn must_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'
                | '\u{180e}'
                | '\u{200b}'..='\u{200f}'
                | '\u{2028}'..='\u{202e}'
                | '\u{2060}'..='\u{2064}'
                | '\u{2066}'..='\u{2069}'
                | '\u{feff}'
                | '\u{fff9}'..='\u{fffb}'
        )
}

/// See [`numbers`].
pub struct Numbers<'a, T>(&'a [T]);

/// Entries shown at the start and at the end of a long list.
const LIST_HEAD: usize = 8;
const LIST_TAIL: usize = 2;

impl<T: fmt::Display> fmt::Display for Numbers<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let items = self.0;
        f.write_str("[")?;
        if items.len() <= LIST_HEAD + LIST_TAIL {
            write_list(f, items)?;
        } else {
            write_list(f, &items[..LIST_HEAD])?;
            let hidden = items.len() - LIST_HEAD - LIST_TAIL;
            write!(f, ", ... {hidden} more ..., ")?;
            write_list(f, &items[items.len() - LIST_TAIL..])?;
        }
        f.write_str("]")
    }
}

fn write_list<T: fmt::Display>(f: &mut fmt::Formatter<'_>, items: &[T]) -> fmt::Result {
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        write!(f, "{item}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_are_shown_as_they_are() {
        assert_eq!(name("layers.0.attn/mm_1").to_string(), "layers.0.attn/mm_1");
        assert_eq!(name("übung·名前").to_string(), "übung·名前");
    }

    #[test]
    fn control_and_invisible_characters_are_escaped() {
        assert_eq!(name("a\nb").to_string(), "a\\nb");
        assert_eq!(name("\r\t\\").to_string(), "\\r\\t\\\\");
        assert_eq!(name("\u{1b}[2J").to_string(), "\\u{1b}[2J");
        assert_eq!(
            name("x\u{202e}y\u{7f}\u{85}").to_string(),
            "x\\u{202e}y\\u{7f}\\u{85}"
        );
        assert_eq!(
            name("\u{2028}\u{feff}\0").to_string(),
            "\\u{2028}\\u{feff}\\u{0}"
        );
    }

    #[test]
    fn a_long_name_keeps_head_and_tail_and_counts_the_cut() {
        let long = format!(
            "{}{}{}",
            "h".repeat(1000),
            "m".repeat(1_000_000),
            "t".repeat(1000)
        );
        let shown = name(&long).to_string();
        let keep = kept_at_each_end(NAME_LIMIT);
        let cut = long.len() - 2 * keep;
        assert_eq!(
            shown,
            format!(
                "{}[... {cut} bytes cut ...]{}",
                "h".repeat(keep),
                "t".repeat(keep)
            )
        );
    }

    #[test]
    fn a_name_at_the_limit_is_whole_and_one_byte_more_is_cut() {
        let at_limit = "n".repeat(NAME_LIMIT);
        assert_eq!(name(&at_limit).to_string(), at_limit);
        let over = "n".repeat(NAME_LIMIT + 1);
        assert!(name(&over).to_string().contains("bytes cut"));
    }

    #[test]
    fn cuts_fall_on_character_boundaries() {
        // Multi-byte characters straddle every possible cut position.
        for pad in 0..4 {
            let long = format!("{}{}", "a".repeat(pad), "é名😀".repeat(200));
            let shown = name(&long).to_string();
            let (head, rest) = shown.split_once("[... ").unwrap();
            let (cut, tail) = rest.split_once(" bytes cut ...]").unwrap();
            assert_eq!(
                head.len() + tail.len() + cut.parse::<usize>().unwrap(),
                long.len()
            );
            assert!(long.starts_with(head) && long.ends_with(tail));
        }
    }

    #[test]
    fn escapes_in_a_shortened_name_are_kept_whole() {
        let long = "\n".repeat(10_000);
        let shown = name(&long).to_string();
        assert!(!shown.contains('\n'));
        assert!(shown.len() < 2 * NAME_LIMIT + 40, "{} bytes", shown.len());
    }

    #[test]
    fn long_lists_show_their_ends() {
        assert_eq!(numbers(&[1, 2, 3]).to_string(), "[1, 2, 3]");
        let long: Vec<i64> = (0..1000).collect();
        assert_eq!(
            numbers(&long).to_string(),
            "[0, 1, 2, 3, 4, 5, 6, 7, ... 990 more ..., 998, 999]"
        );
    }
}
