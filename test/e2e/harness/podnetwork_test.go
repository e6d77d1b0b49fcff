package harness

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
)

func TestPodNetworkConflist(t *testing.T) {
	subnets := map[string]int{}
	for _, i := range []int{0, 1, 255} {
		n, err := newPodNetwork(i)
		if err != nil {
			t.Fatal(err)
		}
		var conf struct {
			Plugins []struct {
				Type, Bridge string
				IsGateway    bool
				IPMasq       bool
				IPAM         struct {
					Type    string
					DataDir string
					Ranges  [][]struct{ Subnet string }
				}
			}
		}
		if err := json.Unmarshal([]byte(n.conflist("/run/x/cni-ipam")), &conf); err != nil {
			t.Fatalf("network %d: conflist is not JSON: %v", i, err)
		}
		if len(conf.Plugins) != 1 {
			t.Fatalf("network %d: plugins %+v, want the bridge alone", i, conf.Plugins)
		}
		p := conf.Plugins[0]
		if p.Type != "bridge" || p.Bridge != n.bridge || len(p.Bridge) > 15 || p.IsGateway || p.IPMasq {
			t.Errorf("network %d: %+v, want bridge %s (at most 15 bytes), no gateway, no masquerading", i, p, n.bridge)
		}
		if p.IPAM.Type != "host-local" || p.IPAM.DataDir != "/run/x/cni-ipam" || len(p.IPAM.Ranges) != 1 || len(p.IPAM.Ranges[0]) != 1 {
			t.Fatalf("network %d: ipam %+v", i, p.IPAM)
		}
		s := p.IPAM.Ranges[0][0].Subnet
		if j, dup := subnets[s]; dup {
			t.Errorf("networks %d and %d share subnet %s", j, i, s)
		}
		subnets[s] = i
	}
	for _, i := range []int{-1, 256} {
		if _, err := newPodNetwork(i); err == nil {
			t.Errorf("pod network %d accepted: its subnet would not be 10.88.<i>.0/24", i)
		}
	}
}

func TestUbuntuStandIn(t *testing.T) {
	dir := t.TempDir()
	bb := filepath.Join(dir, "busybox")
	if err := os.WriteFile(bb, []byte("#!busybox"), 0o755); err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(dir, "ubuntu.tar")
	if err := WriteUbuntuStandIn(dst, bb); err != nil {
		t.Fatal(err)
	}
	outer := readTar(t, mustRead(t, dst))
	var manifest []struct {
		RepoTags []string
		Layers   []string
	}
	if err := json.Unmarshal(outer["manifest.json"].data, &manifest); err != nil {
		t.Fatal(err)
	}
	if len(manifest) != 1 || !slices.Equal(manifest[0].RepoTags, []string{UbuntuStandInImage}) || len(manifest[0].Layers) != 1 {
		t.Fatalf("manifest = %+v, want one image tagged %s", manifest, UbuntuStandInImage)
	}
	layer := readTar(t, outer[manifest[0].Layers[0]].data)
	if e := layer["bin/busybox"]; e.hdr == nil || string(e.data) != "#!busybox" {
		t.Errorf("bin/busybox = %+v", e)
	}
	if e := layer["bin/sh"]; e.hdr == nil || e.hdr.Linkname != "busybox" {
		t.Errorf("bin/sh = %+v, want a link to busybox", e)
	}
	bash := layer["bin/bash"]
	if bash.hdr == nil || bash.hdr.Mode&0o111 == 0 {
		t.Fatalf("bin/bash = %+v, want an executable", bash)
	}
	// The script hands `bash -c CMD` to sh as it is: run it with this machine's sh standing in for busybox's.
	script := filepath.Join(dir, "bash")
	if err := os.WriteFile(script, bash.data, 0o755); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(script, "-c", `echo "$0:$1"; trap 'exit 0' TERM; true & wait`, "zero", "one").CombinedOutput()
	if err != nil || string(out) != "zero:one\n" {
		t.Errorf("bash -c as NVIDIA's pods run it: %q, %v; want zero:one", out, err)
	}
}
