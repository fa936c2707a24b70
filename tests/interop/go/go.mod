module sidecarclient

go 1.23

require github.com/apache/thrift v0.22.0
