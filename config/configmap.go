package config

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// ParseConfigMap reads a ConfigMap's data, in which every key holds a file
// of one of the three formats, into one File. As in NVIDIA's device plugin
// config map:
//
//   - a key holding an NVIDIA device-plugin config becomes the config named
//     after the key (so nvidia.com/device-plugin.config=<key> selects it);
//   - a key holding a gpu-agent file contributes its configs, nodes and
//     mig-configs;
//   - a key holding a mig-parted file contributes its mig-configs entries
//     (for nvidia.com/mig.config), and, as when that file is used alone, a
//     config per entry that serves its layout, unless another key defines a
//     config of that name, which then wins.
//
// A config, mig-configs entry or node defined by two keys is an error
// naming both. References may cross keys: a nodes: entry may name a config
// of another key, a migPartedConfig an entry of a mig-parted key.
//
// defaultKey (NVIDIA's config.default; "" for none) names the config used
// when no node entry or label selects one, ahead of the config named
// "default"; it must name a config. When it is "", the map has no config
// named "default" and its only config comes from a single device-plugin
// key, that key is the default (NVIDIA's "single" fallback); the result's
// DefaultKey says which.
//
// Bounds: the whole map (keys and values) is at most MaxBytes, as the API
// server bounds a ConfigMap; MaxStructure and the key length bound apply to
// each key; the alias-expansion budget (nodes and value bytes) is the whole
// map's, since everything decoded ends up in the one File.
//
// Keys are read in sorted order. Errors are an ErrorList whose entries name
// the key (FieldError.Key) with the path and line within it; warnings are
// prefixed "key <key>: ". A map of one key holding a gpu-agent file gives
// what Parse gives for that file.
func ParseConfigMap(data map[string]string, defaultKey string) (*File, []string, error) {
	return ParseConfigMapWith(data, defaultKey, ParseOptions{})
}

// ParseConfigMapWith is ParseConfigMap with the agent's options
// (--mig-strategy).
func ParseConfigMapWith(data map[string]string, defaultKey string, o ParseOptions) (*File, []string, error) {
	total := 0
	for k, v := range data {
		total += len(k) + len(v)
	}
	if total > MaxBytes {
		return nil, nil, ErrorList{{Msg: fmt.Sprintf("ConfigMap of %d bytes (keys and values) exceeds the maximum of %d bytes (a ConfigMap's limit)", total, MaxBytes)}}
	}
	if len(data) == 0 {
		return nil, nil, ErrorList{{Msg: "ConfigMap has no keys"}}
	}

	var warnings []string
	var errs ErrorList
	var parts []mapPart
	// The decoder's budget carries from key to key: a few hundred bytes of
	// aliases expand to the whole budget, and a thousand such keys would
	// otherwise expand to a thousand budgets.
	spentNodes, spentBytes, suggested := 0, 0, 0
	for _, key := range slices.Sorted(maps.Keys(data)) {
		if msg := checkConfigMapKey(key); msg != "" {
			// The API server enforces this; a directory's file names or a
			// caller's map need not, and a key can become a config name.
			errs = append(errs, &FieldError{Key: key, Msg: msg})
			continue
		}
		d := newDecoder()
		d.nodes, d.bytes, d.shared, d.suggested = spentNodes, spentBytes, true, suggested
		f, w, err := parse([]byte(data[key]), d, checkLocal, o)
		spentNodes, spentBytes, suggested = d.nodes, d.bytes, d.suggested
		warnings = append(warnings, prefixAll(key, w)...)
		if err != nil {
			errs = append(errs, inKey(key, err)...)
			if d.tooLarge {
				break // the budget is spent: later keys cannot be read
			}
			continue
		}
		parts = append(parts, mapPart{key, f})
	}

	out, w, mergeErrs := mergeParts(parts, defaultKey, len(errs) == 0)
	warnings = append(warnings, w...)
	errs = append(errs, mergeErrs...)
	if len(errs) > 0 {
		return nil, warnings, errs.err()
	}
	out.DefaultMIGStrategy = o.MIGStrategy
	return out, warnings, nil
}

// mapPart is one key of a ConfigMap, parsed and checked on its own.
type mapPart struct {
	key string
	f   *File
}

// origin is where a merged name was defined, for the clash error.
type origin struct {
	key  string
	path string
	line int
}

// mergeParts merges the keys' files into one and checks what needs them
// all: clashes, references across keys and the default key. Only clashes
// are checked unless complete (every key was read): the rest could name
// what the key that failed defines.
func mergeParts(parts []mapPart, defaultKey string, complete bool) (*File, []string, ErrorList) {
	out := &File{Version: Version, Configs: map[string]*Config{}}
	var warnings []string
	var errs ErrorList
	configFrom := map[string]origin{}
	migFrom := map[string]origin{}
	nodeFrom := map[string]origin{}
	define := func(what, name string, at origin, seen map[string]origin) bool {
		if first, dup := seen[name]; dup {
			errs = append(errs, &FieldError{Key: at.key, Path: at.path, Line: at.line,
				Msg: fmt.Sprintf("%s %q is also defined by key %s", what, name, quoteKey(first.key))})
			return false
		}
		seen[name] = at
		return true
	}
	here := func(p mapPart, path string) origin {
		return origin{p.key, path, p.f.lineOf(path)}
	}
	// What a key defines keeps its lines, for the errors the planner finds
	// in a MIG layout (Selected.MIGError).
	out.keys, out.lines = map[string]string{}, map[string]int{}
	keep := func(p mapPart, top string) { out.keys[top] = p.key }

	// Configs users wrote first, so that those a mig-parted key implies
	// (one per entry) only fill the names left free.
	onlyDevicePluginKey, written := "", 0
	for _, p := range parts {
		switch p.f.Format {
		case FormatNVIDIADevicePlugin:
			// The whole key is the config: a clash is reported at the key.
			if define("config", p.key, origin{key: p.key}, configFrom) {
				out.Configs[p.key] = p.f.Configs[DefaultConfigName]
				if !isLabelValue(p.key) {
					warnings = append(warnings, fmt.Sprintf("key %s: not a valid label value, so the %s label cannot select this config",
						quoteKey(p.key), DevicePluginConfigLabel))
				}
			}
			onlyDevicePluginKey, written = p.key, written+1
		case FormatGPUAgent:
			for _, name := range sortedKeys(p.f.Configs) {
				if define("config", name, here(p, joinKey("configs", name)), configFrom) {
					out.Configs[name] = p.f.Configs[name]
					keep(p, joinKey("configs", name))
				}
				written++
			}
			for _, node := range sortedKeys(p.f.Nodes) {
				if define("nodes: entry for node", node, here(p, joinKey("nodes", node)), nodeFrom) {
					if out.Nodes == nil {
						out.Nodes = map[string]string{}
					}
					out.Nodes[node] = p.f.Nodes[node]
				}
			}
		}
		for _, name := range sortedKeys(p.f.MigConfigs) {
			if define("mig-configs entry", name, here(p, joinKey("mig-configs", name)), migFrom) {
				if out.MigConfigs == nil {
					out.MigConfigs = map[string]MigLayout{}
				}
				out.MigConfigs[name] = p.f.MigConfigs[name]
				keep(p, joinKey("mig-configs", name))
			}
		}
	}
	for _, p := range parts {
		for path, line := range p.f.lines {
			if top := topEntry(path); top != "" && out.keys[top] == p.key {
				out.lines[path] = line
			}
		}
	}
	for _, p := range parts {
		if p.f.Format != FormatMigParted {
			continue
		}
		for _, name := range sortedKeys(p.f.Configs) {
			if _, taken := out.Configs[name]; !taken {
				out.Configs[name] = p.f.Configs[name]
			}
		}
	}
	out.Format = FormatGPUAgent // the converted form, unless every key is of one format
	for i, p := range parts {
		if i == 0 {
			out.Format = p.f.Format
		} else if p.f.Format != out.Format {
			out.Format = FormatGPUAgent
			break
		}
	}
	if len(errs) > 0 || !complete {
		return nil, warnings, errs
	}

	// References, checked in the file that makes them (for its paths and
	// lines) against the whole map's names.
	for _, p := range parts {
		v := newValidator(p.f, checkRefs)
		v.configs, v.migs = out.Configs, out.MigConfigs
		v.file()
		errs = append(errs, inKey(p.key, v.errs)...)
	}

	_, hasDefault := out.Configs[DefaultConfigName]
	switch {
	case defaultKey != "":
		if _, ok := out.Configs[defaultKey]; !ok {
			errs = append(errs, &FieldError{Msg: fmt.Sprintf("default key %q names no config (configs: %s)", defaultKey, listNames(out.Configs))})
		}
		out.DefaultKey = defaultKey
	case !hasDefault && written == 1 && onlyDevicePluginKey != "":
		out.DefaultKey = onlyDevicePluginKey
	}
	v := newValidator(out, checkWhole)
	v.file()
	warnings = append(warnings, v.warnings...)
	errs = append(errs, v.errs...)
	if len(errs) > 0 {
		return nil, warnings, errs
	}
	return out, warnings, nil
}

// topEntry is the "configs.<name>" or "mig-configs.<name>" that path is
// in, "" for none.
func topEntry(path string) string {
	for p := path; p != ""; {
		parent := parentPath(p)
		if parent == "configs" || parent == "mig-configs" {
			return p
		}
		p = parent
	}
	return ""
}

// checkConfigMapKey applies Kubernetes' rule for a ConfigMap key; "" when
// it is valid.
func checkConfigMapKey(k string) string {
	switch {
	case k == "":
		return "empty key"
	case len(k) > maxKeyBytes:
		return fmt.Sprintf("key of %d bytes exceeds the maximum of %d bytes", len(k), maxKeyBytes)
	case k == "." || strings.HasPrefix(k, ".."):
		return `not a valid ConfigMap key: "." or starting with ".."`
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-' || c == '.') {
			return "not a valid ConfigMap key: only letters, digits, '-', '_' and '.' are allowed"
		}
	}
	return ""
}

// inKey attributes the errors in err to a ConfigMap key.
func inKey(key string, err error) ErrorList {
	var el ErrorList
	if !errors.As(err, &el) {
		return ErrorList{{Key: key, Msg: err.Error()}}
	}
	out := make(ErrorList, 0, len(el))
	for _, e := range el {
		c := *e
		c.Key = key
		out = append(out, &c)
	}
	return out
}

func prefixAll(key string, ws []string) []string {
	out := make([]string, 0, len(ws))
	for _, w := range ws {
		out = append(out, "key "+quoteKey(key)+": "+w)
	}
	return out
}

// ReadDir reads a mounted ConfigMap volume into a ConfigMap's data: one
// entry per key file, each read through ReadFile's bounds, and at most
// MaxBytes in all (keys and values, as ParseConfigMap counts them).
//
// The kubelet lays such a volume out as a timestamped directory holding
// the keys, a symlink ..data to it, and a symlink per key into ..data; an
// update writes a new timestamped directory and swaps ..data. When ..data
// exists it is resolved once and the keys read from its target, so all of
// them come from one version even if a swap happens meanwhile (the old
// directory is then deleted, which fails the read instead of mixing
// versions; the Watcher reads again). Entries whose names start with ".."
// are the kubelet's and skipped (a ConfigMap key cannot start so), as are
// directories (a key's items path with a "/"; keys themselves have none).
// Any other directory is read the same way, each regular file (or symlink
// to one) a key.
func ReadDir(dir string) (map[string]string, error) {
	src := dir
	if target, err := os.Readlink(filepath.Join(dir, "..data")); err == nil {
		if !filepath.IsAbs(target) {
			target = filepath.Join(dir, target)
		}
		src = target
	}
	entries, err := os.ReadDir(src)
	if err != nil {
		return nil, fmt.Errorf("config dir %s: %w", dir, err)
	}
	out := map[string]string{}
	total := 0
	for _, e := range entries {
		name := e.Name()
		if strings.HasPrefix(name, "..") {
			continue
		}
		p := filepath.Join(src, name)
		st, err := os.Stat(p)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) && src == dir {
				continue // a key symlink left dangling by an update in progress
			}
			return nil, fmt.Errorf("config dir %s: %w", dir, err)
		}
		if st.IsDir() {
			continue
		}
		b, err := ReadFile(p)
		if err != nil {
			return nil, err // names the key's path
		}
		total += len(name) + len(b)
		if total > MaxBytes {
			return nil, fmt.Errorf("config dir %s: more than %d bytes in all (a ConfigMap's limit)", dir, MaxBytes)
		}
		out[name] = string(b)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("config dir %s: no key files", dir)
	}
	return out, nil
}

// LoadDir reads a mounted ConfigMap volume (see ReadDir) and parses it as
// ParseConfigMap does, with no default key. Like Load for a file: the
// error names the directory and wraps the ErrorList.
func LoadDir(dir string) (*File, []string, error) {
	data, err := ReadDir(dir)
	if err != nil {
		return nil, nil, err // names the directory already
	}
	f, warnings, err := ParseConfigMap(data, "")
	if err != nil {
		return nil, warnings, fmt.Errorf("config dir %s: %w", dir, err)
	}
	return f, warnings, nil
}
