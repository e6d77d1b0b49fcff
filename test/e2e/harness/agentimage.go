package harness

import (
	"bufio"
	"bytes"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strings"
)

// AgentImage assembles the gpu-agent image that the Dockerfile's last stage describes, without a Docker engine:
// its base must be a distroless image, its one COPY the gpu-agent binary that an earlier stage's `go build -o`
// writes (agentBin stands in for it), and its ENV, LABEL, USER, EXPOSE, ENTRYPOINT and CMD are taken as they
// are (ARG defaults substituted). Any other instruction in the last stage is an error, so that a Dockerfile
// change this emulation does not cover fails the suite instead of being ignored. The distroless base is
// stood in for by what the binary needs from it: for distroless/base (glibc), the ELF interpreter and shared
// libraries the binary links, copied from this host (Debian 12 here, as base-debian12 is), plus /etc/passwd and
// /etc/group; for distroless/static, nothing (the binary must be static). Ref is left for the caller to set.
func AgentImage(dockerfile, agentBin string) (ImageSpec, error) {
	b, err := os.ReadFile(dockerfile)
	if err != nil {
		return ImageSpec{}, err
	}
	stages, err := parseDockerfile(string(b))
	if err != nil {
		return ImageSpec{}, fmt.Errorf("%s: %w", dockerfile, err)
	}
	spec, err := imageFromStages(stages, agentBin)
	if err != nil {
		return ImageSpec{}, fmt.Errorf("%s: %w", dockerfile, err)
	}
	return spec, nil
}

// dockerStage is one FROM ... stage: its base, its name, and its instructions with arguments (continuation
// lines joined, comments dropped).
type dockerStage struct {
	base, name string
	instrs     []dockerInstr
	args       map[string]string // ARG defaults in scope (global ones included), for substitution
}

type dockerInstr struct{ cmd, args string }

func parseDockerfile(text string) ([]*dockerStage, error) {
	var logical []string
	var cur strings.Builder
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue // comments may also sit between continuation lines
		}
		if strings.HasSuffix(line, `\`) {
			cur.WriteString(strings.TrimSuffix(line, `\`) + " ")
			continue
		}
		cur.WriteString(line)
		logical = append(logical, cur.String())
		cur.Reset()
	}
	if cur.Len() > 0 {
		return nil, errors.New("continuation at end of file")
	}
	global := map[string]string{}
	var stages []*dockerStage
	for _, l := range logical {
		cmd, args, _ := strings.Cut(l, " ")
		cmd, args = strings.ToUpper(cmd), strings.TrimSpace(args)
		if cmd == "FROM" {
			f := strings.Fields(args)
			st := &dockerStage{args: map[string]string{}}
			switch {
			case len(f) == 1:
			case len(f) == 3 && strings.EqualFold(f[1], "AS"):
				st.name = f[2]
			default:
				return nil, fmt.Errorf("FROM %s: unsupported form", args)
			}
			st.base = substitute(f[0], global)
			stages = append(stages, st)
			continue
		}
		if len(stages) == 0 {
			if cmd != "ARG" {
				return nil, fmt.Errorf("%s before the first FROM", cmd)
			}
			name, val, _ := strings.Cut(args, "=")
			global[name] = val
			continue
		}
		st := stages[len(stages)-1]
		if cmd == "ARG" {
			name, val, ok := strings.Cut(args, "=")
			if !ok {
				val = global[name] // a redeclared global ARG keeps its default
			}
			st.args[name] = val
		}
		st.instrs = append(st.instrs, dockerInstr{cmd, args})
	}
	if len(stages) == 0 {
		return nil, errors.New("no FROM")
	}
	return stages, nil
}

var varRef = regexp.MustCompile(`\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)`)

// substitute replaces $NAME and ${NAME} with vars' values (unknown names become empty, as in Docker).
func substitute(s string, vars map[string]string) string {
	return varRef.ReplaceAllStringFunc(s, func(m string) string {
		name := strings.Trim(m, "${}")
		return vars[name]
	})
}

// words splits s at unquoted white space and removes double quotes (key="a b" is one word, key=a b).
func words(s string) ([]string, error) {
	var out []string
	var w strings.Builder
	inWord, quoted := false, false
	for i := 0; i < len(s); i++ {
		ch := s[i]
		switch {
		case ch == '\\' && i+1 < len(s):
			i++
			w.WriteByte(s[i])
			inWord = true
		case ch == '"':
			quoted = !quoted
			inWord = true
		case (ch == ' ' || ch == '\t') && !quoted:
			if inWord {
				out = append(out, w.String())
				w.Reset()
				inWord = false
			}
		default:
			w.WriteByte(ch)
			inWord = true
		}
	}
	if quoted {
		return nil, fmt.Errorf("unterminated quote in %q", s)
	}
	if inWord {
		out = append(out, w.String())
	}
	return out, nil
}

// keyValues reads LABEL/ENV arguments: key=value pairs, or ENV's legacy `key value` form.
func keyValues(cmd, args string) ([][2]string, error) {
	ws, err := words(args)
	if err != nil {
		return nil, err
	}
	if len(ws) > 0 && !strings.Contains(ws[0], "=") {
		if cmd != "ENV" || len(ws) < 2 {
			return nil, fmt.Errorf("%s %s: want key=value", cmd, args)
		}
		return [][2]string{{ws[0], strings.Join(ws[1:], " ")}}, nil
	}
	var kvs [][2]string
	for _, w := range ws {
		k, v, ok := strings.Cut(w, "=")
		if !ok {
			return nil, fmt.Errorf("%s %s: %q is not key=value", cmd, args, w)
		}
		kvs = append(kvs, [2]string{k, v})
	}
	return kvs, nil
}

var goBuildOut = regexp.MustCompile(`go build\b[^&;|]*?\s-o\s+(\S+)[^&;|]*\s\./cmd/gpu-agent\b`)

func imageFromStages(stages []*dockerStage, agentBin string) (ImageSpec, error) {
	last := stages[len(stages)-1]
	var spec ImageSpec
	var glibc bool
	switch {
	case strings.HasPrefix(last.base, "gcr.io/distroless/base") || strings.HasPrefix(last.base, "gcr.io/distroless/cc"):
		glibc = true
	case strings.HasPrefix(last.base, "gcr.io/distroless/static"):
	default:
		return spec, fmt.Errorf("last stage FROM %s: the e2e image stands in for distroless bases only", last.base)
	}
	// distroless's own PATH.
	spec.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	vars := last.args
	copied := false
	for _, in := range last.instrs {
		args := in.args
		switch in.cmd {
		case "ARG":
		case "LABEL":
			kvs, err := keyValues(in.cmd, substitute(args, vars))
			if err != nil {
				return spec, err
			}
			if spec.Labels == nil {
				spec.Labels = map[string]string{}
			}
			for _, kv := range kvs {
				spec.Labels[kv[0]] = kv[1]
			}
		case "ENV":
			kvs, err := keyValues(in.cmd, substitute(args, vars))
			if err != nil {
				return spec, err
			}
			for _, kv := range kvs {
				spec.Env = setEnv(spec.Env, kv[0], kv[1])
			}
		case "COPY":
			if copied {
				return spec, fmt.Errorf("COPY %s: the e2e image supports one COPY (the binary)", args)
			}
			f := strings.Fields(args)
			if len(f) != 3 || !strings.HasPrefix(f[0], "--from=") {
				return spec, fmt.Errorf("COPY %s: want COPY --from=STAGE SRC DST", args)
			}
			src, err := buildOutput(stages, strings.TrimPrefix(f[0], "--from="))
			if err != nil {
				return spec, err
			}
			if f[1] != src {
				return spec, fmt.Errorf("COPY %s: the build stage writes gpu-agent to %s", args, src)
			}
			bin, err := os.ReadFile(agentBin)
			if err != nil {
				return spec, err
			}
			spec.Files = append(spec.Files, ImageFile{Path: f[2], Mode: 0o755, Data: bin})
			copied = true
		case "USER":
			spec.User = substitute(args, vars)
		case "EXPOSE":
			for _, p := range strings.Fields(substitute(args, vars)) {
				if !strings.Contains(p, "/") {
					p += "/tcp"
				}
				spec.ExposedPorts = append(spec.ExposedPorts, p)
			}
		case "ENTRYPOINT", "CMD":
			var argv []string
			if err := json.Unmarshal([]byte(args), &argv); err != nil {
				return spec, fmt.Errorf("%s %s: want the exec (JSON) form: %w", in.cmd, args, err)
			}
			if in.cmd == "ENTRYPOINT" {
				spec.Entrypoint = argv
			} else {
				spec.Cmd = argv
			}
		default:
			return spec, fmt.Errorf("last stage: %s is not supported by the e2e image", in.cmd)
		}
	}
	if !copied {
		return spec, errors.New("last stage copies no gpu-agent binary")
	}
	libs, err := elfRuntimeFiles(agentBin)
	if err != nil {
		return spec, err
	}
	if len(libs) > 0 && !glibc {
		return spec, fmt.Errorf("%s is dynamically linked, but the base %s has no libc", agentBin, last.base)
	}
	if glibc {
		spec.Files = append(spec.Files, libs...)
		spec.Files = append(spec.Files,
			ImageFile{Path: "/etc/passwd", Mode: 0o644, Data: []byte("root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n")},
			ImageFile{Path: "/etc/group", Mode: 0o644, Data: []byte("root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n")})
	}
	sort.Strings(spec.ExposedPorts)
	return spec, nil
}

func setEnv(env []string, k, v string) []string {
	for i, kv := range env {
		if strings.HasPrefix(kv, k+"=") {
			env[i] = k + "=" + v
			return env
		}
	}
	return append(env, k+"="+v)
}

// buildOutput returns where stage name's `go build -o OUT ./cmd/gpu-agent` writes the binary.
func buildOutput(stages []*dockerStage, name string) (string, error) {
	for _, st := range stages {
		if st.name != name {
			continue
		}
		for _, in := range st.instrs {
			if in.cmd != "RUN" {
				continue
			}
			if m := goBuildOut.FindStringSubmatch(in.args); m != nil {
				return substitute(m[1], st.args), nil
			}
		}
		return "", fmt.Errorf("stage %s: no `go build -o OUT ./cmd/gpu-agent`", name)
	}
	return "", fmt.Errorf("no stage named %s", name)
}

// libDirs are where this host keeps the shared libraries a binary links, in the loader's order; the image
// keeps each at the path it was found at, which is also on the loader's default path.
func libDirs() []string {
	triplet := map[string]string{"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}[runtime.GOARCH]
	var dirs []string
	if triplet != "" {
		dirs = append(dirs, "/lib/"+triplet, "/usr/lib/"+triplet)
	}
	return append(dirs, "/lib64", "/usr/lib64", "/lib", "/usr/lib")
}

// elfRuntimeFiles returns the ELF interpreter and the shared libraries (transitively) that bin needs at run
// time, read from this host; none for a static binary.
func elfRuntimeFiles(bin string) ([]ImageFile, error) {
	files := map[string]ImageFile{}
	var visit func(p string) error
	visit = func(p string) error {
		f, err := elf.Open(p)
		if err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		defer f.Close()
		for _, prog := range f.Progs {
			if prog.Type != elf.PT_INTERP {
				continue
			}
			b := make([]byte, prog.Filesz)
			if _, err := prog.ReadAt(b, 0); err != nil {
				return fmt.Errorf("%s: interpreter: %w", p, err)
			}
			interp := string(bytes.TrimRight(b, "\x00"))
			if _, ok := files[interp]; !ok {
				data, err := os.ReadFile(interp)
				if err != nil {
					return fmt.Errorf("%s: interpreter: %w", p, err)
				}
				files[interp] = ImageFile{Path: interp, Mode: 0o755, Data: data}
			}
		}
		needed, err := f.ImportedLibraries()
		if err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		for _, lib := range needed {
			found := ""
			for _, d := range libDirs() {
				if _, err := os.Stat(filepath.Join(d, lib)); err == nil {
					found = path.Join(d, lib)
					break
				}
			}
			if found == "" {
				return fmt.Errorf("%s needs %s, which is not in %v", p, lib, libDirs())
			}
			if _, ok := files[found]; ok {
				continue
			}
			data, err := os.ReadFile(found)
			if err != nil {
				return err
			}
			files[found] = ImageFile{Path: found, Mode: 0o755, Data: data}
			if err := visit(found); err != nil {
				return err
			}
		}
		return nil
	}
	if err := visit(bin); err != nil {
		return nil, err
	}
	out := make([]ImageFile, 0, len(files))
	for _, f := range files {
		out = append(out, f)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out, nil
}
