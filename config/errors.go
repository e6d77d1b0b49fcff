package config

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
)

// FieldError is one problem in a config file, at a field path such as
// configs.default.sharing.timeSlicing.resources[0].replicas.
type FieldError struct {
	// Key is the ConfigMap key whose content has the problem (ParseConfigMap,
	// LoadDir); "" for a single file or the ConfigMap as a whole. Path and
	// Line are then within that key's content.
	Key string
	// Path in the file as the user wrote it; "" for the whole file.
	Path string
	// Line is 1-based; 0 when unknown (e.g. a File built in code).
	Line int
	Msg  string
}

func (e *FieldError) Error() string {
	var b strings.Builder
	if e.Key != "" {
		b.WriteString("key ")
		b.WriteString(quoteKey(e.Key))
		b.WriteString(": ")
	}
	if e.Path != "" {
		b.WriteString(e.Path)
		b.WriteString(": ")
	}
	b.WriteString(e.Msg)
	if e.Line > 0 {
		fmt.Fprintf(&b, " (line %d)", e.Line)
	}
	return b.String()
}

// ErrorList is every problem found in a file, sorted by line. Parse returns
// it as its error; use errors.As to get at the entries.
type ErrorList []*FieldError

func (l ErrorList) Error() string {
	switch len(l) {
	case 0:
		return "no errors"
	case 1:
		return l[0].Error()
	}
	// A log line or /status field with thousands of entries helps nobody;
	// the list itself keeps them all.
	const maxShown = 50
	var msgs []string
	for i, e := range l {
		if i == maxShown {
			msgs = append(msgs, fmt.Sprintf("... and %d more", len(l)-maxShown))
			break
		}
		msgs = append(msgs, e.Error())
	}
	return fmt.Sprintf("%d errors:\n%s", len(l), strings.Join(msgs, "\n"))
}

// sorted orders by key, then line, then path, then message, so output is
// stable; an entry without a line (0) sorts first, as it concerns the whole
// file (or ConfigMap).
func (l ErrorList) sorted() ErrorList {
	sort.SliceStable(l, func(i, j int) bool {
		a, b := l[i], l[j]
		if a.Key != b.Key {
			return a.Key < b.Key
		}
		if a.Line != b.Line {
			return a.Line < b.Line
		}
		if a.Path != b.Path {
			return a.Path < b.Path
		}
		return a.Msg < b.Msg
	})
	return l
}

// err returns l as an error, or a nil error (not a nil ErrorList) when empty.
func (l ErrorList) err() error {
	if len(l) == 0 {
		return nil
	}
	return l.sorted()
}

// isPlainKey reports whether a key needs no brackets in a path.
func isPlainKey(k string) bool {
	if k == "" {
		return false
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// quoteKey writes a ConfigMap key as it is when it only has the characters
// Kubernetes allows in one ([-._a-zA-Z0-9]), else quoted: a key read from a
// directory can be any file name, and must not garble the message.
func quoteKey(k string) string {
	for i := 0; i < len(k); i++ {
		c := k[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-' || c == '.') {
			return strconv.Quote(k)
		}
	}
	if k == "" {
		return `""`
	}
	return k
}

// joinKey appends a mapping key to a path. Keys with dots or other
// punctuation (node names, "1g.10gb") are bracketed so the path stays
// unambiguous.
func joinKey(path, key string) string {
	if !isPlainKey(key) {
		return path + "[" + strconv.Quote(key) + "]"
	}
	if path == "" {
		return key
	}
	return path + "." + key
}

// joinIndex appends a list index to a path.
func joinIndex(path string, i int) string {
	return path + "[" + strconv.Itoa(i) + "]"
}

// pathRewrite maps a prefix of a converted File's path to the prefix the
// user wrote in the original format.
type pathRewrite struct{ from, to string }

// originalPath turns a path of the converted File into the user's path.
func (f *File) originalPath(p string) string {
	for _, r := range f.rewrites {
		if p == r.from {
			return r.to
		}
		if strings.HasPrefix(p, r.from) {
			rest := p[len(r.from):]
			if rest[0] == '.' || rest[0] == '[' {
				if r.to == "" {
					return strings.TrimPrefix(rest, ".")
				}
				return r.to + rest
			}
		}
	}
	return p
}

// lineOf finds the line of a path, or of its nearest recorded ancestor (a
// missing field is reported at the mapping that lacks it).
func (f *File) lineOf(p string) int {
	for p != "" {
		if l, ok := f.lines[p]; ok {
			return l
		}
		p = parentPath(p)
	}
	return 0
}

// parentPath strips the last key or index from a path.
func parentPath(p string) string {
	if strings.HasSuffix(p, "]") {
		// The bracket may hold a quoted key containing "[", so find the
		// opening bracket of the last segment by scanning quotes.
		if i := lastBracket(p); i >= 0 {
			return p[:i]
		}
		return ""
	}
	if i := strings.LastIndexAny(p, ".]"); i >= 0 {
		if p[i] == ']' {
			return p[:i+1]
		}
		return p[:i]
	}
	return ""
}

// lastBracket returns the index of the "[" that opens p's final segment.
func lastBracket(p string) int {
	inQuote := false
	open := -1
	for i := 0; i < len(p); i++ {
		switch c := p[i]; {
		case inQuote && c == '\\':
			i++
		case c == '"':
			inQuote = !inQuote
		case !inQuote && c == '[':
			open = i
		}
	}
	return open
}
