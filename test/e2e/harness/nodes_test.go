package harness

import (
	"slices"
	"strings"
	"testing"
)

func TestParseCgroupMounts(t *testing.T) {
	mountinfo := strings.Join([]string{
		`25 30 0:22 / /sys/fs/cgroup ro,nosuid,nodev,noexec - tmpfs tmpfs ro,mode=755`,
		`26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw`,
		`27 25 0:24 / /sys/fs/cgroup/systemd rw,nosuid shared:11 - cgroup cgroup rw,xattr,name=systemd`,
		`30 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:14 - cgroup cgroup rw,cpu,cpuacct`,
		`31 25 0:28 / /sys/fs/cgroup/odd\040name rw - cgroup cgroup rw,memory`,
		`40 30 0:40 / /proc rw - proc proc rw`,
		// A mount whose source names cgroup is not one: the type decides.
		`41 30 0:41 / /mnt/x rw - tmpfs cgroup rw`,
		`malformed`,
		``,
	}, "\n")
	got := parseCgroupMounts(mountinfo)
	want := []string{"/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd", "/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/odd name"}
	if !slices.Equal(got, want) {
		t.Errorf("parseCgroupMounts = %q, want %q", got, want)
	}
}

// addNodeAddress refuses what the kubelet refuses as --node-ip, before it touches any interface.
func TestAddNodeAddressRefuses(t *testing.T) {
	for _, ip := range []string{"", "not-an-ip", "127.0.1.1", "127.0.0.1", "::1", "fd00::5"} {
		if _, err := addNodeAddress(ip); err == nil {
			t.Errorf("addNodeAddress(%q): no error", ip)
		}
	}
}
