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

// ParseConfigMap reads a ConfigMap's data: every key is a file of one of
// the three formats. Like NVIDIA's device plugin config map, a key holding
// an NVIDIA device-plugin config becomes the config named after the key; a
// key holding a gpu-agent file contributes its configs, nodes and
// mig-configs; a key holding a mig-parted file contributes its mig-configs
// (and, as when mounted alone, a config per entry). A name defined by two
// keys is an error naming both. defaultKey (NVIDIA's config.default; "" =
// none) names the config used when no node entry or label selects one. One
// key holding a gpu-agent file is the same as Parse of that file.
//
// Errors and warnings are prefixed with the key. The whole ConfigMap is
// bounded by MaxBytes, as the API server bounds it.
func ParseConfigMap(data map[string]string, defaultKey string) (*File, []string, error) {
	total := 0
	for k, v := range data {
		total += len(k) + len(v)
	}
	if total > MaxBytes {
		return nil, nil, ErrorList{{Msg: fmt.Sprintf("ConfigMap of %d bytes exceeds the maximum of %d bytes", total, MaxBytes)}}
	}
	if len(data) == 0 {
		return nil, nil, ErrorList{{Msg: "ConfigMap has no keys"}}
	}
	out := &File{Version: Version, Format: FormatGPUAgent, Configs: map[string]*Config{}, DefaultKey: defaultKey}
	configFrom := map[string]string{} // config name → key that defined it
	migFrom := map[string]string{}
	nodeFrom := map[string]string{}
	var warnings []string
	var errs ErrorList
	keyErr := func(key string, err error) {
		var el ErrorList
		if errors.As(err, &el) {
			for _, e := range el {
				e.Path = keyPath(key, e.Path)
				errs = append(errs, e)
			}
			return
		}
		errs = append(errs, &FieldError{Path: keyPath(key, ""), Msg: err.Error()})
	}
	keys := slices.Sorted(maps.Keys(data))
	if len(keys) == 1 {
		f, w, err := Parse([]byte(data[keys[0]]))
		if err != nil {
			keyErr(keys[0], err)
			return nil, prefixAll(keys[0], w), errs
		}
		if f.Format == FormatNVIDIADevicePlugin && keys[0] != DefaultConfigName {
			// NVIDIA's map: the config is named after its key; with one key
			// it is also what every node gets.
			f.Configs = map[string]*Config{keys[0]: f.Configs[DefaultConfigName]}
			if defaultKey == "" {
				defaultKey = keys[0]
			}
		}
		f.DefaultKey = defaultKey
		return f, prefixAll(keys[0], w), checkDefaultKey(f)
	}
	for _, key := range keys {
		f, w, err := Parse([]byte(data[key]))
		warnings = append(warnings, prefixAll(key, w)...)
		if err != nil {
			keyErr(key, err)
			continue
		}
		configs := f.Configs
		if f.Format == FormatNVIDIADevicePlugin {
			configs = map[string]*Config{key: f.Configs[DefaultConfigName]}
		}
		for name, c := range configs {
			if other, dup := configFrom[name]; dup {
				errs = append(errs, &FieldError{Path: keyPath(key, "configs."+name), Msg: fmt.Sprintf("config %q is also defined by key %q", name, other)})
				continue
			}
			configFrom[name] = key
			out.Configs[name] = c
		}
		for name, l := range f.MigConfigs {
			if other, dup := migFrom[name]; dup {
				errs = append(errs, &FieldError{Path: keyPath(key, "mig-configs."+name), Msg: fmt.Sprintf("mig-configs entry %q is also defined by key %q", name, other)})
				continue
			}
			migFrom[name] = key
			if out.MigConfigs == nil {
				out.MigConfigs = map[string]MigLayout{}
			}
			out.MigConfigs[name] = l
		}
		for node, name := range f.Nodes {
			if other, dup := nodeFrom[node]; dup {
				errs = append(errs, &FieldError{Path: keyPath(key, "nodes."+node), Msg: fmt.Sprintf("node %q is also listed by key %q", node, other)})
				continue
			}
			nodeFrom[node] = key
			if out.Nodes == nil {
				out.Nodes = map[string]string{}
			}
			out.Nodes[node] = name
		}
	}
	if len(errs) > 0 {
		return nil, warnings, errs
	}
	for node, name := range out.Nodes {
		if _, ok := out.Configs[name]; !ok {
			errs = append(errs, &FieldError{Path: keyPath(nodeFrom[node], "nodes."+node), Msg: fmt.Sprintf("names config %q, which no key defines", name)})
		}
	}
	for name, c := range out.Configs {
		if p := c.MIG.MigPartedConfig; p != "" {
			if _, ok := out.MigConfigs[p]; !ok {
				errs = append(errs, &FieldError{Path: keyPath(configFrom[name], "configs."+name+".mig.migPartedConfig"), Msg: fmt.Sprintf("names mig-configs entry %q, which no key defines", p)})
			}
		}
	}
	if len(errs) > 0 {
		return nil, warnings, errs
	}
	return out, warnings, checkDefaultKey(out)
}

func checkDefaultKey(f *File) error {
	if f.DefaultKey == "" {
		return nil
	}
	if _, ok := f.Configs[f.DefaultKey]; !ok {
		return ErrorList{{Msg: fmt.Sprintf("default key %q names no config (defined: %s)", f.DefaultKey, listNames(f.Configs))}}
	}
	return nil
}

func keyPath(key, path string) string {
	if path == "" {
		return "key " + key
	}
	return "key " + key + ": " + path
}

func prefixAll(key string, ws []string) []string {
	out := make([]string, 0, len(ws))
	for _, w := range ws {
		out = append(out, "key "+key+": "+w)
	}
	return out
}

// ReadDir reads a mounted ConfigMap volume: every key file (the kubelet's
// ..data and timestamped entries are skipped, key symlinks followed), each
// through ReadFile's bounds.
func ReadDir(dir string) (map[string]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("config dir %s: %w", dir, err)
	}
	out := map[string]string{}
	total := 0
	for _, e := range entries {
		name := e.Name()
		if strings.HasPrefix(name, "..") || strings.HasPrefix(name, ".") {
			continue
		}
		p := filepath.Join(dir, name)
		st, err := os.Stat(p)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				continue // a key removed mid-update
			}
			return nil, fmt.Errorf("config dir %s: %w", dir, err)
		}
		if st.IsDir() {
			continue
		}
		b, err := ReadFile(p)
		if err != nil {
			return nil, err
		}
		total += len(b)
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
