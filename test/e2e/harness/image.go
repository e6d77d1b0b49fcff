package harness

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path"
	"runtime"
	"sort"
	"time"
)

// Image references the suite imports into containerd. They are written without a registry host; the kubelet and
// containerd both normalise them to docker.io/..., so the pod specs and the sandbox_image setting agree.
const (
	PauseImage   = "gpu-agent-e2e/pause:v1"
	BusyboxImage = "gpu-agent-e2e/busybox:v1"
)

// ImageFile is one regular file or symlink of a single-layer image.
type ImageFile struct {
	Path     string // absolute path inside the image, e.g. /bin/busybox
	Mode     int64  // permission bits; ignored for symlinks
	Data     []byte // contents of a regular file
	Linkname string // non-empty makes this a symlink to Linkname
}

// ImageSpec describes a single-layer image in the docker-archive format that `ctr images import` reads.
type ImageSpec struct {
	Ref        string // repository:tag recorded in manifest.json
	Files      []ImageFile
	Entrypoint []string
	Env        []string
	// Cmd, User, Labels and ExposedPorts (e.g. "9400/tcp") are left out of the config when empty.
	Cmd          []string
	User         string
	Labels       map[string]string
	ExposedPorts []string
}

// WriteDockerArchive writes spec as a docker-archive tarball (manifest.json, config blob, one layer.tar) to
// dst. The suite has no registry, so this is how images reach containerd.
func WriteDockerArchive(dst string, spec ImageSpec) error {
	layer, err := layerTar(spec.Files)
	if err != nil {
		return fmt.Errorf("image %s: layer: %w", spec.Ref, err)
	}
	layerSum := sha256.Sum256(layer)
	layerHex := hex.EncodeToString(layerSum[:])

	imageConfig := map[string]any{
		"Entrypoint": spec.Entrypoint,
		"Env":        spec.Env,
	}
	if len(spec.Cmd) > 0 {
		imageConfig["Cmd"] = spec.Cmd
	}
	if spec.User != "" {
		imageConfig["User"] = spec.User
	}
	if len(spec.Labels) > 0 {
		imageConfig["Labels"] = spec.Labels
	}
	if len(spec.ExposedPorts) > 0 {
		ports := map[string]any{}
		for _, p := range spec.ExposedPorts {
			ports[p] = map[string]any{}
		}
		imageConfig["ExposedPorts"] = ports
	}
	// The config's diff_ids must be the digest of the uncompressed layer, or containerd refuses to unpack.
	config, err := json.Marshal(map[string]any{
		"architecture": runtime.GOARCH,
		"os":           "linux",
		"created":      time.Unix(0, 0).UTC().Format(time.RFC3339),
		"config":       imageConfig,
		"rootfs": map[string]any{
			"type":     "layers",
			"diff_ids": []string{"sha256:" + layerHex},
		},
	})
	if err != nil {
		return fmt.Errorf("image %s: config: %w", spec.Ref, err)
	}
	configSum := sha256.Sum256(config)
	configName := hex.EncodeToString(configSum[:]) + ".json"
	layerName := layerHex + "/layer.tar"

	manifest, err := json.Marshal([]map[string]any{{
		"Config":   configName,
		"RepoTags": []string{spec.Ref},
		"Layers":   []string{layerName},
	}})
	if err != nil {
		return fmt.Errorf("image %s: manifest: %w", spec.Ref, err)
	}

	var out bytes.Buffer
	tw := tar.NewWriter(&out)
	for _, f := range []struct {
		name string
		data []byte
	}{
		{configName, config},
		{layerName, layer},
		{"manifest.json", manifest},
	} {
		if err := writeTarFile(tw, f.name, 0o644, f.data); err != nil {
			return fmt.Errorf("image %s: %s: %w", spec.Ref, f.name, err)
		}
	}
	if err := tw.Close(); err != nil {
		return fmt.Errorf("image %s: %w", spec.Ref, err)
	}
	if err := os.WriteFile(dst, out.Bytes(), 0o644); err != nil {
		return fmt.Errorf("image %s: %w", spec.Ref, err)
	}
	return nil
}

// layerTar renders files as an uncompressed layer, with every parent directory listed before its children
// (overlayfs unpacking does not invent missing directories with sane modes).
func layerTar(files []ImageFile) ([]byte, error) {
	dirs := map[string]bool{}
	for _, f := range files {
		for d := path.Dir(path.Clean(f.Path)); d != "/" && d != "."; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	sortedDirs := make([]string, 0, len(dirs))
	for d := range dirs {
		sortedDirs = append(sortedDirs, d)
	}
	sort.Strings(sortedDirs) // a parent sorts before its children

	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, d := range sortedDirs {
		hdr := &tar.Header{Typeflag: tar.TypeDir, Name: d[1:] + "/", Mode: 0o755, ModTime: time.Unix(0, 0)}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, fmt.Errorf("%s: %w", d, err)
		}
	}
	for _, f := range files {
		name := path.Clean(f.Path)
		if !path.IsAbs(name) || name == "/" {
			return nil, fmt.Errorf("%q: image paths must be absolute file paths", f.Path)
		}
		if f.Linkname != "" {
			hdr := &tar.Header{Typeflag: tar.TypeSymlink, Name: name[1:], Linkname: f.Linkname, Mode: 0o777, ModTime: time.Unix(0, 0)}
			if err := tw.WriteHeader(hdr); err != nil {
				return nil, fmt.Errorf("%s: %w", name, err)
			}
			continue
		}
		if err := writeTarFile(tw, name[1:], f.Mode, f.Data); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func writeTarFile(tw *tar.Writer, name string, mode int64, data []byte) error {
	hdr := &tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: mode, Size: int64(len(data)), ModTime: time.Unix(0, 0)}
	if err := tw.WriteHeader(hdr); err != nil {
		return err
	}
	_, err := tw.Write(data)
	return err
}

// BuildImages writes the pause and busybox images into dir and returns the tarball paths. pauseBin is the
// static binary of ./cmd/pause, busyboxBin a static busybox (Debian's busybox-static installs /bin/busybox).
func BuildImages(dir, pauseBin, busyboxBin string) ([]string, error) {
	pause, err := os.ReadFile(pauseBin)
	if err != nil {
		return nil, fmt.Errorf("pause image: %w", err)
	}
	bb, err := os.ReadFile(busyboxBin)
	if err != nil {
		return nil, fmt.Errorf("busybox image: %w", err)
	}
	bbFiles := []ImageFile{{Path: "/bin/busybox", Mode: 0o755, Data: bb}}
	// The commands the suite's pods run; each is a symlink to /bin/busybox.
	for _, a := range []string{"sh", "env", "sleep", "cat", "ls", "echo", "true", "false", "test", "grep"} {
		bbFiles = append(bbFiles, ImageFile{Path: "/bin/" + a, Linkname: "busybox"})
	}
	specs := []ImageSpec{
		{Ref: PauseImage, Files: []ImageFile{{Path: "/pause", Mode: 0o755, Data: pause}}, Entrypoint: []string{"/pause"}},
		{Ref: BusyboxImage, Files: bbFiles, Entrypoint: []string{"/bin/sh"}, Env: []string{"PATH=/bin"}},
	}
	paths := make([]string, 0, len(specs))
	for i, spec := range specs {
		p := path.Join(dir, fmt.Sprintf("image-%d.tar", i))
		if err := WriteDockerArchive(p, spec); err != nil {
			return nil, err
		}
		paths = append(paths, p)
	}
	return paths, nil
}

// UbuntuStandInImage is the image NVIDIA's demo pods name (demo/specs/imex, the quickstart's imex-test1). There
// is no registry here, so WriteUbuntuStandIn builds an image under that name from the suite's busybox.
const UbuntuStandInImage = "ubuntu:22.04"

// WriteUbuntuStandIn writes, as a docker-archive at dst, a stand-in for ubuntu:22.04 made of the static
// busybox at busyboxBin: what NVIDIA's demo pods run, `bash -c "ls -la ...; trap 'exit 0' TERM; sleep 9999 &
// wait"`, with `bash` a script that hands its arguments to busybox's sh (ash runs those commands alike). It is
// not Ubuntu: a command of such a pod that needs more than busybox fails, and says so in its log.
func WriteUbuntuStandIn(dst, busyboxBin string) error {
	bb, err := os.ReadFile(busyboxBin)
	if err != nil {
		return fmt.Errorf("image %s: %w", UbuntuStandInImage, err)
	}
	files := []ImageFile{
		{Path: "/bin/busybox", Mode: 0o755, Data: bb},
		{Path: "/bin/bash", Mode: 0o755, Data: []byte("#!/bin/sh\nexec /bin/sh \"$@\"\n")},
	}
	for _, a := range []string{"sh", "env", "sleep", "cat", "ls", "echo", "true", "false", "test", "grep"} {
		files = append(files, ImageFile{Path: "/bin/" + a, Linkname: "busybox"})
	}
	return WriteDockerArchive(dst, ImageSpec{Ref: UbuntuStandInImage, Files: files, Cmd: []string{"/bin/bash"},
		Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}})
}
